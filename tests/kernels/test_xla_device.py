"""The xla and pallas backends on the torch_xla CPU device, on row pools: correctness and a flat compile count."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("jax")
pytest.importorskip("torchax")

import torch_xla.debug.metrics as metrics  # noqa: E402

from adapter_manager.kernels import BackendKind, KernelConfig, expand, select_backend, shrink, shrink_parts  # noqa: E402
from adapter_manager.kernels.config import PallasInterpret  # noqa: E402
from tests.kernels._cases import (  # noqa: E402
    STALE,
    TOLERANCE,
    PartsPool,
    RowPool,
    collapse_laned,
    make_rows,
    parts_pool,
    reference_forward,
)

CONFIGS = {
    "xla": KernelConfig(xla_backend=BackendKind.XLA),
    "pallas": KernelConfig(xla_backend=BackendKind.PALLAS, pallas_interpret=PallasInterpret.HLO),
}
NUM_SLOTS, RANK, IN, OUT = 6, 8, 40, 72


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def on_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of ``rows`` as a strided view (row stride features + 5) of a larger device buffer."""
    buffer = torch.full((rows.shape[0], rows.shape[1] + 5), float("nan"), dtype=rows.dtype)
    buffer[:, : rows.shape[1]] = rows
    return buffer.to(device)[:, : rows.shape[1]]


class Step:
    """One engine-like step: swap an adapter into a slot in place, prepare the metadata, run one LoRA layer."""

    def __init__(self, name: str, pool: RowPool, max_tokens: int, seed: int = 0) -> None:
        self.device = torch_xla.device()
        self.pool = pool
        self.meta = pool.meta(select_backend(self.device, CONFIGS[name]), max_tokens, self.device)
        self.gen = torch.Generator().manual_seed(seed)
        self.a_dev, self.bt_dev = on_device(pool.a_rows, self.device), on_device(pool.bt_rows, self.device)

    def swap(self, slot: int) -> None:
        """Write a new adapter of a random rank r into the slot's R rows (rows past r: stale garbage), in place with
        a device index tensor, so neither the slot nor the rank is baked into the graph."""
        pool, r = self.pool, int(torch.randint(1, RANK + 1, (1,), generator=self.gen))
        new_a = torch.randn(RANK, IN, generator=self.gen) * STALE
        new_bt = torch.randn(RANK, OUT, generator=self.gen) * STALE
        new_a[:r] = torch.randn(r, IN, generator=self.gen) / IN**0.5
        new_bt[:r] = torch.randn(r, OUT, generator=self.gen) / RANK**0.5
        rows = slot * pool.granule + torch.arange(RANK)
        pool.a_rows[rows], pool.bt_rows[rows] = new_a, new_bt
        pool.slot_rows[slot] = r
        index = rows.to(self.device)
        self.a_dev.index_copy_(0, index, new_a.to(self.device))
        self.bt_dev.index_copy_(0, index, new_bt.to(self.device))
        torch_xla.sync()  # the swap is its own graph, as the pool's copy would be

    def run(self, num_tokens: int, slots: torch.Tensor) -> None:
        x = torch.randn(num_tokens, IN, generator=self.gen)
        y = torch.randn(num_tokens, OUT, generator=self.gen)
        self.meta.prepare(slots, self.pool.slot_rows)
        h = shrink(x.to(self.device), self.a_dev, self.meta)
        y_new = expand(y.to(self.device), h, self.bt_dev, self.meta)
        torch_xla.sync()
        _, y_ref = reference_forward(x, y, self.pool, slots)
        result = y_new.cpu()
        torch.testing.assert_close(result, y_ref, **TOLERANCE[torch.float32])
        assert torch.equal(result[slots < 0], y[slots < 0])

    def slots_with(self, num_tokens: int, num_active: int) -> torch.Tensor:
        """[T] int32 over exactly ``num_active`` random slots (and some -1 tokens when there is room)."""
        chosen = torch.randperm(NUM_SLOTS, generator=self.gen)[:num_active]
        picks = torch.randint(-1, num_active, (num_tokens,), generator=self.gen)
        picks[:num_active] = torch.arange(num_active)
        picks = picks[torch.randperm(num_tokens, generator=self.gen)]
        return torch.where(picks >= 0, chosen[picks.clamp(min=0)], -1).to(torch.int32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_correct_and_no_recompile_after_warmup(name):
    """Warm-up runs every (token bucket, active bucket) once; then swaps (new ranks, stale rows), active sets of
    every size 0..S and mixed ranks must not change the graph."""
    pool = make_rows(NUM_SLOTS, RANK, RANK, IN, OUT, torch.Generator().manual_seed(0), full_rank=False)
    step = Step(name, pool, max_tokens=32)
    token_buckets = (8, 32)
    assert step.meta.active_buckets == (1, 4, 6)
    for num_tokens in token_buckets:
        for num_active in step.meta.active_buckets:
            step.swap(num_active - 1)
            step.run(num_tokens, step.slots_with(num_tokens, num_active))
    warmed = compile_count()
    assert warmed > 0
    for num_active in (0, 2, 5, 3, 1, 6):
        for num_tokens in token_buckets:
            step.swap(int(torch.randint(0, NUM_SLOTS, (1,), generator=step.gen)))
            slots = step.slots_with(num_tokens, num_active) if num_active else torch.full((num_tokens,), -1)
            step.run(num_tokens, slots.to(torch.int32))
    assert compile_count() == warmed, f"{name}: slot indices, ranks or pool contents changed the graph"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_large_pool_with_granule_below_rank(name):
    """256 slot ids of granule 4, adapters of rank ≤ 16 spanning up to four granules; a step uses a few."""
    pool = make_rows(256, 16, 4, IN, OUT, torch.Generator().manual_seed(1))
    step = Step(name, pool, max_tokens=32, seed=1)
    for mix in ("zipf", "distinct", "single_with_none"):
        step.run(32, pool.slots(mix, 32, step.gen))


def test_xla_bf16():
    pool = make_rows(NUM_SLOTS, RANK, RANK, IN, OUT, torch.Generator().manual_seed(2)).to(torch.bfloat16)
    step = Step("xla", pool, max_tokens=16, seed=2)
    x, y = torch.randn(16, IN, generator=step.gen).bfloat16(), torch.randn(16, OUT, generator=step.gen).bfloat16()
    slots = pool.slots("uniform", 16, step.gen)
    step.meta.prepare(slots, pool.slot_rows)
    device = step.device
    y_new = expand(y.to(device), shrink(x.to(device), step.a_dev, step.meta), step.bt_dev, step.meta).cpu()
    _, y_ref = reference_forward(x, y, pool, slots)
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCE[torch.bfloat16])
    assert torch.equal(y_new[slots < 0], y[slots < 0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shrink_parts_loops_the_parts_on_device(name):
    """Traced backends shrink part by part: h[p] is the per-part laned shrink exactly, and the reference's h[p]."""
    pp = parts_pool(3, NUM_SLOTS, RANK, RANK, in_f=IN, seed=5)
    device = torch_xla.device()
    meta = pp.pool.meta(select_backend(device, CONFIGS[name]), 32, device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, IN, generator=gen)
    slots = pp.pool.slots("zipf", 32, gen)
    meta.prepare(slots, pp.pool.slot_rows)
    on_device = PartsPool(pp.buffer.to(device), pp.pool, pp.parts, pp.in_features)
    h = shrink_parts(x.to(device), on_device.a_parts, meta)
    per_part = [shrink(x.to(device), on_device.part(p), meta) for p in range(3)]
    torch_xla.sync()
    assert h.shape == (3, 32, meta.active_width * RANK)
    reference = select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE))
    ref_meta = pp.pool.meta(reference, 32)
    ref_meta.prepare(slots, pp.pool.slot_rows)
    for p in range(3):
        torch.testing.assert_close(h[p].cpu(), per_part[p].cpu(), atol=0, rtol=0)
        expected = shrink(x, pp.part(p), ref_meta)
        torch.testing.assert_close(collapse_laned(h[p].cpu(), RANK), expected, **TOLERANCE[torch.float32])
