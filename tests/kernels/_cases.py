"""Shared test inputs: adversarial slot mixes, LoRA stacks and the fp32 reference oracle."""

from __future__ import annotations

import torch

from kernels import BackendKind, KernelConfig, LoRAKernelMeta, expand, select_backend, shrink

MIXES = ("none", "single", "single_with_none", "distinct", "uniform", "zipf", "skewed", "empty_slots")
TOLERANCE = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


def slot_mix(name: str, num_tokens: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """[T] int32 slot indices of one named mix."""
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
        slots = torch.where(torch.rand(num_tokens, generator=gen) < 0.9, 0, torch.randint(0, num_slots, (num_tokens,)))
    elif name == "empty_slots":
        slots = torch.randint(-1, (num_slots + 1) // 2, (num_tokens,), generator=gen) * 2
        slots = slots.clamp(min=-1)
    else:
        raise ValueError(name)
    return slots.to(torch.int32)


def make_stacks(
    num_slots: int, rank: int, in_features: int, out_features: int, gen: torch.Generator, used_rank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, in] and Bt [S, R, out]; ranks beyond ``used_rank`` are zero (padded adapters)."""
    a = torch.randn(num_slots, rank, in_features, generator=gen) / in_features**0.5
    bt = torch.randn(num_slots, rank, out_features, generator=gen) / rank**0.5
    if used_rank is not None:
        a[:, used_rank:] = 0
        bt[:, used_rank:] = 0
    return a, bt


def reference_forward(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [T, R], y_new [T, out]) from the fp32 loop reference on fp32 copies of the inputs."""
    backend = select_backend("cpu", KernelConfig(backend=BackendKind.REFERENCE))
    meta = LoRAKernelMeta.make(backend, a.shape[0], a.shape[1], max(slots.shape[0], 1), "cpu")
    meta.prepare(slots)
    h = shrink(x.float(), a.float(), meta)
    return h, expand(y.float().clone(), h, bt.float(), meta)


def collapse_laned(h: torch.Tensor, num_slots: int, rank: int) -> torch.Tensor:
    """[T, S·R] laned h -> [T, R]: each row has at most one slot's lanes nonzero, so the sum is exact."""
    return h.reshape(h.shape[0], num_slots, rank).sum(1)
