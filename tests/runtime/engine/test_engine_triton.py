"""The engine on the triton backend, its kernels in Triton's interpreter (CPU tensors): greedy completions of PEFT
adapters through 2 slots (swaps included) equal HF + PEFT generate. Kept to four requests: every kernel program is a
Python call in interpret mode."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.kernels import BackendKind, KernelConfig
from adapter_manager.runtime.engine import SamplingParams
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import ENGINE_NEW_TOKENS, ENGINE_REQUESTS

pytestmark = pytest.mark.usefixtures("triton_interpret")
REQUESTS = ENGINE_REQUESTS[:4]
"""qv, the base model, all_rslora, patterns: three adapters for two slots."""


def _answers_equal_peft(written, expected, requests, on_engine=lambda engine: None) -> None:
    """The engine on the triton backend serves ``requests``; each greedy answer equals HF + PEFT generate.
    ``on_engine`` looks at the engine before it serves (building it happens inside the caller's context)."""
    model = load_model(written[None][0], dtype=torch.float32)
    manager = AdapterManager(
        model.config.to_spec(TINY_NAME), AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8))
    )
    try:
        for name in {name for _, name in requests if name is not None}:
            manager.register(str(written[name][0]), adapter_id=name)
        kernels = KernelConfig(backend=BackendKind.TRITON)
        scheduler = SchedulerConfig(token_budget=12)
        config = EngineConfig(max_batch=4, max_seq_len=64, scheduler=scheduler, eos_ids=(), kernels=kernels)
        engine = Engine(model, manager, config)
        on_engine(engine)
        handles = [engine.submit(p, a, SamplingParams(max_tokens=ENGINE_NEW_TOKENS)) for p, a in requests]
        engine.run_until_idle(max_steps=200)
        for handle, (prompt, name) in zip(handles, requests, strict=True):
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
    finally:
        manager.close()


def test_engine_on_the_triton_backend_matches_peft(written, expected):
    _answers_equal_peft(written, expected, REQUESTS)


def test_where_decode_graphs_cannot_be_captured_the_engine_decodes_eagerly_and_says_why(written, expected, monkeypatch):
    """The engine's first contact with graph capture fails (here: a CPU model, as a GPU that refuses to capture
    would): one warning naming why, decode_mode "eager", and the same answers."""
    import adapter_manager.runtime.engine.step_runner as engine_module

    monkeypatch.setattr(engine_module, "can_capture", lambda meta: True)  # as on a cuda device with triton

    def eager(engine: Engine) -> None:
        assert engine.decode_mode == "eager" and engine._runner.graphs is None  # noqa: SLF001

    with pytest.warns(RuntimeWarning, match="CUDA graphs off, decode steps run eagerly: .*cuda"):
        _answers_equal_peft(written, expected, REQUESTS[:2], eager)
