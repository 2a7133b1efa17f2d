"""The XLA lane's engine trace on one device: warm-up with every slot filled, then random arrivals of (prompt,
adapter) rows with swaps, counting what compiles after warm-up (the variants' and the vocabulary modules' tests)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from adapter_manager import AdapterManager
from adapter_manager.kernels import KernelConfig
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig

BUCKETS = (8, 16, 32)


def compile_count() -> int:
    import torch_xla.debug.metrics as metrics

    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def serve_trace(
    model, manager: AdapterManager, rows: Sequence[tuple[list[int], str | None]], fill: list[str], new_tokens: int,
    seed: int, kernels: KernelConfig | None = None,
) -> tuple[list[tuple[object, list[int], str | None]], int, int]:  # fmt: skip
    """An engine over ``model`` and ``manager`` (max_batch 4, token buckets :data:`BUCKETS`, ``kernels`` its backend
    choice), the ``fill`` adapters in its slots, warmed up; then 80 steps with 0-2 random rows arriving in each of the
    first 60, run until idle.
    Returns (each request's handle, prompt and adapter; the warm-up's graphs; the compiles after warm-up)."""
    config = EngineConfig(
        max_batch=4, max_seq_len=32, scheduler=SchedulerConfig(token_budget=32), token_buckets=BUCKETS, eos_ids=(),
        kernels=kernels,
    )
    engine = Engine(model, manager, config)
    manager.release(manager.acquire(fill))  # every slot filled
    graphs = engine.warm_up()
    warmed = compile_count()
    rng, handles = random.Random(seed), []
    for step in range(80):
        for _ in range(rng.choice((0, 1, 1, 2)) if step < 60 else 0):
            prompt, name = rng.choice(rows)
            handles.append((engine.submit(prompt, name, SamplingParams(max_tokens=new_tokens)), prompt, name))
        engine.step()
    engine.run_until_idle(max_steps=200)
    return handles, graphs, compile_count() - warmed
