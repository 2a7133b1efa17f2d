"""Shared test inputs: adversarial slot mixes, LoRA row pools with stale rows, and the fp32 reference oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapter_manager.kernels import (
    BackendKind,
    KernelConfig,
    LoRAForm,
    LoRAKernelMeta,
    apply_parts,
    expand,
    select_backend,
    shrink,
)
from adapter_manager.kernels.dispatch_table import DispatchEntry, TorchDispatchTable
from adapter_manager.kernels.torch_eager import TorchEagerBackend
from adapter_manager.kernels.xla_laned import XlaLanedBackend

MIXES = ("none", "single", "single_with_none", "distinct", "uniform", "zipf", "skewed", "empty_slots")
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
STALE = 100.0
"""Scale of the garbage in rows no adapter owns (stale rows of old adapters): a kernel that reads one fails."""


def slot_mix(name: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """[T] int32 indices of one named mix, each in [-1, num_slots)."""
    if name == "none":
        slots = torch.full((num_tokens,), -1)
    elif name == "single":
        slots = torch.full((num_tokens,), num_slots - 1)
    elif name == "single_with_none":
        slots = torch.where(torch.rand(num_tokens, generator=gen) < 0.5, num_slots // 2, -1)
    elif name == "distinct":
        slots = torch.randperm(max(num_tokens, num_slots), generator=gen)[:num_tokens] % num_slots
    elif name == "uniform":
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    elif name == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 2, dtype=torch.float64)
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=gen) - 1
    elif name == "skewed":
        others = torch.randint(0, num_slots, (num_tokens,), generator=gen)
        slots = torch.where(torch.rand(num_tokens, generator=gen) < 0.9, 0, others)
    elif name == "empty_slots":
        slots = torch.randint(-1, (num_slots + 1) // 2, (num_tokens,), generator=gen) * 2
        slots = slots.clamp(min=-1)
    else:
        raise ValueError(name)
    return slots.to(torch.int32)


@dataclass
class RowPool:
    """One (layer, projection)'s row pools and the adapters placed in them."""

    a_rows: torch.Tensor
    """Shape: [N, in], a strided view (row stride > in) of a larger buffer."""
    bt_rows: torch.Tensor
    """Shape: [N, out], likewise."""
    slot_rows: dict[int, int]
    """r_s of every slot holding an adapter."""
    slot_ids: torch.Tensor
    """Shape: [n] int64, the slots holding an adapter, ascending: mixes index this (adapter i -> slot_ids[i])."""
    num_slots: int
    rank: int
    granule: int

    def slots(self, mix: str, num_tokens: int, gen: torch.Generator) -> torch.Tensor:
        """[T] int32 slot indices of a named mix over the pool's adapters."""
        adapter = slot_mix(mix, num_tokens, self.slot_ids.numel(), gen).long()
        return torch.where(adapter >= 0, self.slot_ids[adapter.clamp(min=0)], -1).to(torch.int32)

    def to(self, dtype: torch.dtype) -> RowPool:
        a, bt = (_strided(t.to(dtype)) for t in (self.a_rows, self.bt_rows))
        return RowPool(a, bt, self.slot_rows, self.slot_ids, self.num_slots, self.rank, self.granule)

    def meta(self, backend, max_tokens: int, device="cpu", **kwargs) -> LoRAKernelMeta:
        return LoRAKernelMeta.make(
            backend, self.num_slots, self.rank, max_tokens, device, granule=self.granule, **kwargs
        )


def _strided(rows: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """A copy of ``rows`` as a view with row stride ``features + pad`` (inner stride 1), padding filled with NaN."""
    buffer = torch.full((rows.shape[0], rows.shape[1] + pad), float("nan"), dtype=rows.dtype)
    buffer[:, : rows.shape[1]] = rows
    return buffer[:, : rows.shape[1]]


def make_rows(
    num_slots: int,
    rank: int,
    granule: int,
    in_features: int,
    out_features: int,
    gen: torch.Generator,
    *,
    max_adapters: int | None = None,
    full_rank: bool = False,
) -> RowPool:
    """Row pools of ``num_slots``·``granule`` + 1 rows: adapters of mixed ranks 1..R (R with ``full_rank``) placed at
    non-overlapping slots (an adapter of rank r > G spans ⌈r/G⌉ granules), garbage in every row no adapter owns, the
    last row zero. At most ``max_adapters`` adapters."""
    num_rows = num_slots * granule + 1
    a = torch.randn(num_rows, in_features, generator=gen) * STALE
    bt = torch.randn(num_rows, out_features, generator=gen) * STALE
    slot_rows: dict[int, int] = {}
    slot = 0
    while slot < num_slots and (max_adapters is None or len(slot_rows) < max_adapters):
        r = rank if full_rank else int(torch.randint(1, rank + 1, (1,), generator=gen))
        if slot * granule + r > num_slots * granule:
            r = num_slots * granule - slot * granule
        rows = slice(slot * granule, slot * granule + r)
        a[rows] = torch.randn(r, in_features, generator=gen) / in_features**0.5
        bt[rows] = torch.randn(r, out_features, generator=gen) / rank**0.5
        slot_rows[slot] = min(r, rank)
        slot += -(-r // granule)
    a[-1], bt[-1] = 0, 0
    slot_ids = torch.tensor(sorted(slot_rows), dtype=torch.int64)
    return RowPool(_strided(a), _strided(bt), slot_rows, slot_ids, num_slots, rank, granule)


def make_stacks(
    num_slots: int, rank: int, in_features: int, out_features: int, gen: torch.Generator, used_rank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense A [S, R, in] and Bt [S, R, out] (the Pallas kernels' operands: a compact table); ranks beyond
    ``used_rank`` are zero, as the zero row pads them in a gathered table."""
    a = torch.randn(num_slots, rank, in_features, generator=gen) / in_features**0.5
    bt = torch.randn(num_slots, rank, out_features, generator=gen) / rank**0.5
    if used_rank is not None:
        a[:, used_rank:] = 0
        bt[:, used_rank:] = 0
    return a, bt


def dense_pool(a_stack: torch.Tensor, bt_stack: torch.Tensor) -> RowPool:
    """Stacks [S, R, F] as row pools with G = R (the old dense layout) and every slot at full rank."""
    num_slots, rank = a_stack.shape[:2]
    zero = lambda t: t.new_zeros(1, t.shape[2])
    a = torch.cat([a_stack.reshape(-1, a_stack.shape[2]), zero(a_stack)])
    bt = torch.cat([bt_stack.reshape(-1, bt_stack.shape[2]), zero(bt_stack)])
    slot_rows = dict.fromkeys(range(num_slots), rank)
    return RowPool(a, bt, slot_rows, torch.arange(num_slots), num_slots, rank, rank)


def reference_forward(
    x: torch.Tensor, y: torch.Tensor, pool: RowPool, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [T, R], y_new [T, out]) from the fp32 loop reference on fp32 copies of the inputs."""
    backend = select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE))
    meta = pool.meta(backend, max(slots.shape[0], 1))
    meta.prepare(slots, pool.slot_rows)
    h = shrink(x.float(), pool.a_rows.float(), meta)
    return h, expand(y.float().clone(), h, pool.bt_rows.float(), meta)


def collapse_laned(h: torch.Tensor, rank: int) -> torch.Tensor:
    """[T, A·R] laned h -> [T, R]: each row has at most one compact slot's lanes nonzero, so the sum is exact."""
    return h.reshape(h.shape[0], -1, rank).sum(1)


PAD_LEFT, PAD_RIGHT = 5, 7
"""Columns of other modules around the parts' A blocks in the shared row buffer (garbage the kernels never read)."""


@dataclass
class PartsPool:
    """P parts' A rows side by side in one ``[N, 5 + P·in + 7]`` buffer, as the slot pool lays out q/k/v."""

    buffer: torch.Tensor
    pool: RowPool
    """Part 0's pool: its slots, ranks and metadata (every part shares them, as every module of an adapter does)."""
    parts: int
    in_features: int

    @property
    def a_parts(self) -> torch.Tensor:
        """Shape: [N, P, in], a strided view of the buffer (row stride 5 + P·in + 7)."""
        block = self.buffer[:, PAD_LEFT : PAD_LEFT + self.parts * self.in_features]
        return block.view(-1, self.parts, self.in_features)

    def part(self, index: int) -> torch.Tensor:
        """Shape: [N, in], part ``index``'s A rows, the view a per-part shrink reads."""
        start = PAD_LEFT + index * self.in_features
        return self.buffer[:, start : start + self.in_features]

    def to(self, dtype: torch.dtype) -> PartsPool:
        return PartsPool(self.buffer.to(dtype), self.pool, self.parts, self.in_features)


def parts_pool(parts: int, num_slots: int, rank: int, granule: int, in_f: int = 48, seed: int = 0) -> PartsPool:
    """Mixed ranks (part 0's pool decides them), stale garbage in every row past a rank and in the padding columns."""
    gen = torch.Generator().manual_seed(seed + 2000)
    pool = make_rows(num_slots, rank, granule, in_f, 24, gen)
    num_rows = pool.a_rows.shape[0]
    buffer = torch.randn(num_rows, PAD_LEFT + parts * in_f + PAD_RIGHT, generator=gen) * STALE
    buffer[:, PAD_LEFT : PAD_LEFT + in_f] = pool.a_rows
    for index in range(1, parts):
        a = torch.randn(num_rows, in_f, generator=gen) * STALE
        for slot, r in pool.slot_rows.items():
            a[slot * granule : slot * granule + r] = torch.randn(r, in_f, generator=gen) / in_f**0.5
        a[-1] = 0
        buffer[:, PAD_LEFT + index * in_f : PAD_LEFT + (index + 1) * in_f] = a
    return PartsPool(buffer, pool, parts, in_f)


OUTS = (24, 20, 7)
"""Each part's out features: not multiples of the kernel's 4- or 8-row or 1024-column blocks."""


def bt_parts(
    pp: PartsPool, outs: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[torch.Tensor]:
    """The parts' Bt side by side in one ``dtype`` buffer on ``device`` (garbage around them and in every row no
    adapter owns): views with one row stride, as the pool's Bt blocks are."""
    gen = torch.Generator().manual_seed(seed + 7)
    num_rows, granule, rank = pp.buffer.shape[0], pp.pool.granule, pp.pool.rank
    buffer = torch.randn(num_rows, 3 + sum(outs) + 5, generator=gen) * STALE
    views, start = [], 3
    for out in outs:
        for slot, r in pp.pool.slot_rows.items():
            buffer[slot * granule : slot * granule + r, start : start + out] = torch.randn(r, out, generator=gen) / rank
        buffer[-1, start : start + out] = 0
        start += out
    buffer, start = buffer.to(dtype=dtype, device=device), 3
    for out in outs:
        views.append(buffer[:, start : start + out])
        start += out
    return views


def reference_apply_parts(
    y: torch.Tensor, x: torch.Tensor, pp: PartsPool, bts: list[torch.Tensor], slots: torch.Tensor
):
    """The fp32 loop, token by token: y[t, part p] += x[t] @ A_p[rows].T @ Bt_p[rows]."""
    out, granule = y.float().clone(), pp.pool.granule
    start = 0
    for part, bt in enumerate(bts):
        a = pp.part(part).float()
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                rows = slice(slot * granule, slot * granule + pp.pool.slot_rows[slot])
                out[t, start : start + bt.shape[1]] += (x[t].float() @ a[rows].t()) @ bt[rows].float()
        start += bt.shape[1]
    return out


def check_apply_parts(
    backend, pp: PartsPool, num_tokens: int, mix: str, dtype=torch.float32, seed: int = 0, outs=OUTS
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pp = pp.to(dtype)
    outs = outs[: pp.parts]
    bts = bt_parts(pp, outs, seed, dtype)
    x = torch.randn(num_tokens, pp.in_features, generator=gen).to(dtype)
    slots = pp.pool.slots(mix, num_tokens, gen)
    meta = pp.pool.meta(backend, max(128, num_tokens))
    meta.prepare(slots, pp.pool.slot_rows)
    wide = torch.randn(num_tokens, 2 + sum(outs) + 3, generator=gen).to(dtype)  # y is a column view of it
    before = wide.clone()
    y = wide[:, 2 : 2 + sum(outs)]
    expected = reference_apply_parts(y, x, pp, [bt.float() for bt in bts], slots)
    assert apply_parts(y, x, pp.a_parts, bts, meta) is y
    torch.testing.assert_close(y.float(), expected, **TOLERANCE[dtype])
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 2 + sum(outs) :], before[:, 2 + sum(outs) :])
    none = slots < 0
    assert torch.equal(wide[none], before[none]), "slot -1 tokens must get exactly nothing"


# dispatch tables that force one form, and every eager backend the kernel tests compare with the reference
ALWAYS_GROUPED = TorchDispatchTable((DispatchEntry(slots=1, rank=1, laned_max_tokens=0),))
ALWAYS_LANED = TorchDispatchTable((DispatchEntry(slots=1, rank=1, laned_max_tokens=1 << 30),))
BACKENDS = {
    "torch_grouped": lambda: TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=0),
    "torch_laned": lambda: TorchEagerBackend(ALWAYS_LANED, max_segment_runs=0),
    "torch_segments": lambda: TorchEagerBackend(ALWAYS_GROUPED, max_segment_runs=1 << 30),
    "torch_table": lambda: select_backend("cpu", KernelConfig(backend=BackendKind.TORCH)),
    "cpu_auto": lambda: select_backend("cpu"),  # the torch forms plus the fused C++ kernel for small steps
    "cpu_fused": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.FUSED)),
    # forced through the config: the same form for every step with an adapter, single-slot steps included
    "forced_segments": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.SEGMENTS)),
    "forced_grouped": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.GROUPED)),
    "forced_laned": lambda: select_backend("cpu", KernelConfig(torch_form=LoRAForm.LANED)),
    "xla_laned_on_cpu": XlaLanedBackend,
    "reference": lambda: select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE)),
}


def linear_case(
    parts: int,
    outs: tuple[int, ...],
    num_tokens: int,
    mix: str,
    seed: int,
    in_f: int = 48,
    rank: int = 8,
    grouped: bool = False,
):
    """One linear's LoRA operands for the CPU linear kernels: a parts pool (mixed ranks, stale rows), its parts' Bt,
    x, the mix's slots (``grouped``: sorted, as the engine orders a step by adapter, so a prefill's runs are long) and
    the cpu backend's metadata prepared for them; returns them with the generator."""
    gen = torch.Generator().manual_seed(seed)
    pp = parts_pool(parts, 6, rank, rank, in_f=in_f, seed=seed)
    bts = bt_parts(pp, outs[:parts], seed)
    x = torch.randn(num_tokens, in_f, generator=gen)
    slots = pp.pool.slots(mix, num_tokens, gen)
    if grouped:
        slots = torch.sort(slots, stable=True).values
    meta = pp.pool.meta(select_backend("cpu"), max(128, num_tokens))
    meta.prepare(slots, pp.pool.slot_rows)
    return pp, bts, x, slots, meta, gen


def bench_qkv_case(
    runs: list[list[int]], tokens: int = 8
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bench model's q|k|v linear (in 1024, out 1024 + 256 + 256, rank-16 rows of 8 adapters in one row buffer;
    8 tokens: decode) for the CPU linear kernels: (A [N, 3, in], its three Bt, W, x, and the fp64 expectation of
    ``x @ W.T`` plus every run's LoRA)."""
    gen = torch.Generator().manual_seed(9)
    rows, in_f, outs = 8 * 16, 1024, (1024, 256, 256)
    buffer = torch.randn(rows, 3 * in_f + sum(outs), generator=gen) * 0.05
    a = buffer[:, : 3 * in_f].view(rows, 3, in_f)
    bts, col = [], 3 * in_f
    for out in outs:
        bts.append(buffer[:, col : col + out])
        col += out
    w = torch.randn(sum(outs), in_f, generator=gen) * 0.03
    x = torch.randn(tokens, in_f, generator=gen)
    expected, start = x.double() @ w.double().t(), 0
    for p, bt in enumerate(bts):
        for s, c, first, r in runs:
            h = x[s : s + c].double() @ a[first : first + r, p].double().t()
            expected[s : s + c, start : start + bt.shape[1]] += h @ bt[first : first + r].double()
        start += bt.shape[1]
    return a, bts, w, x, expected
