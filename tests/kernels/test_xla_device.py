"""The xla and pallas backends on the torch_xla CPU device: correctness and a flat compile count (XLA lane)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("jax")
pytest.importorskip("torchax")

import torch_xla.debug.metrics as metrics  # noqa: E402

from kernels import BackendKind, KernelConfig, LoRAKernelMeta, expand, select_backend, shrink  # noqa: E402
from kernels.config import PallasInterpret  # noqa: E402
from tests.kernels._cases import TOLERANCE, make_stacks, reference_forward, slot_mix  # noqa: E402

CONFIGS = {
    "xla": KernelConfig(xla_backend=BackendKind.XLA),
    "pallas": KernelConfig(xla_backend=BackendKind.PALLAS, pallas_interpret=PallasInterpret.HLO),
}
NUM_SLOTS, RANK, IN, OUT = 6, 8, 40, 72


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


class Step:
    """One engine-like step: swap an adapter into a slot in place, prepare the metadata, run one LoRA layer."""

    def __init__(self, name: str, max_tokens: int) -> None:
        self.device = torch_xla.device()
        backend = select_backend(self.device, CONFIGS[name])
        self.meta = LoRAKernelMeta.make(backend, NUM_SLOTS, RANK, max_tokens, self.device)
        self.gen = torch.Generator().manual_seed(0)
        self.a, self.bt = make_stacks(NUM_SLOTS, RANK, IN, OUT, self.gen)
        self.a_dev, self.bt_dev = self.a.to(self.device), self.bt.to(self.device)

    def swap(self, slot: int) -> None:
        new_a, new_bt = make_stacks(1, RANK, IN, OUT, self.gen)
        self.a[slot], self.bt[slot] = new_a[0], new_bt[0]
        index = torch.tensor([slot]).to(self.device)  # a device index tensor: the slot is not baked into the graph
        self.a_dev.index_copy_(0, index, new_a.to(self.device))
        self.bt_dev.index_copy_(0, index, new_bt.to(self.device))

    def run(self, bucket: int, mix: str) -> None:
        slots = slot_mix(mix, bucket, NUM_SLOTS, self.gen)
        x = torch.randn(bucket, IN, generator=self.gen)
        y = torch.randn(bucket, OUT, generator=self.gen)
        self.swap(int(torch.randint(0, NUM_SLOTS, (1,), generator=self.gen)))
        self.meta.prepare(slots)
        h = shrink(x.to(self.device), self.a_dev, self.meta)
        y_new = expand(y.to(self.device), h, self.bt_dev, self.meta)
        torch_xla.sync()
        _, y_ref = reference_forward(x, y, self.a, self.bt, slots)
        result = y_new.cpu()
        torch.testing.assert_close(result, y_ref, **TOLERANCE[torch.float32])
        assert torch.equal(result[slots < 0], y[slots < 0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_correct_and_no_recompile_after_warmup(name):
    step = Step(name, max_tokens=32)
    buckets = (8, 32)
    for bucket in buckets:
        step.run(bucket, "uniform")
    warmed = compile_count()
    assert warmed > 0
    for mix in ("zipf", "none", "single", "distinct", "single_with_none", "uniform"):
        for bucket in buckets:
            step.run(bucket, mix)
    assert compile_count() == warmed, f"{name}: slot indices / stack contents changed the graph"


def test_xla_bf16():
    device = torch_xla.device()
    backend = select_backend(device)
    gen = torch.Generator().manual_seed(1)
    a, bt = (t.bfloat16() for t in make_stacks(NUM_SLOTS, RANK, IN, OUT, gen))
    x, y = torch.randn(16, IN, generator=gen).bfloat16(), torch.randn(16, OUT, generator=gen).bfloat16()
    slots = slot_mix("uniform", 16, NUM_SLOTS, gen)
    meta = LoRAKernelMeta.make(backend, NUM_SLOTS, RANK, 16, device)
    meta.prepare(slots)
    y_new = expand(y.to(device), shrink(x.to(device), a.to(device), meta), bt.to(device), meta).cpu()
    _, y_ref = reference_forward(x, y, a, bt, slots)
    torch.testing.assert_close(y_new.float(), y_ref, **TOLERANCE[torch.bfloat16])
    assert torch.equal(y_new[slots < 0], y[slots < 0])
