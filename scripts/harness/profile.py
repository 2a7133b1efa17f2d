"""What a step does inside, from torch's profiler: operator calls, and self time by category."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def op_calls(fn: Callable[[], object]) -> int:
    """Operator calls (profiler events) of one call of ``fn``, after one unprofiled call."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return len(prof.events())


def profile_step(fn: Callable[[], object]) -> dict[str, float]:
    """One profiled call: self time per category (ms) and the time outside any op."""
    fn()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    wall = 1e3 * (time.perf_counter() - start)
    cats = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.key_averages():
        name, ms = event.key, event.self_cpu_time_total / 1e3
        if "scaled_dot_product" in name or "flash_attention" in name:
            cats["attention"] += ms
        elif any(k in name for k in ("mm", "linear_pointwise", "matmul", "linear", "lora_apply")):
            cats["matmul"] += ms
        else:
            cats["other_ops"] += ms
    cats["outside_ops"] = max(wall - sum(cats.values()), 0.0)
    cats["profiled_wall"] = wall
    return {k: round(v, 2) for k, v in cats.items()}
