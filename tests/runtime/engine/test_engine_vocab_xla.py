"""The vocabulary modules on the torch_xla CPU device (XLA lane): embedding / lm_head LoRA and trainable tokens beside
plain LoRA and base rows, more adapters than slots, every greedy generation equal to `PeftModel`'s, and no compile
after warm-up (the vocabulary LoRA is laned in every step's graph, so a vocabulary adapter's arrival changes no
shape)."""

from __future__ import annotations

import random

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import MAX_RANK, hf_greedy
from tests.runtime._vocab import TIED_ROWS, UNTIED_ROWS

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("peft")

import torch_xla.debug.metrics as metrics  # noqa: E402

BUCKETS = (8, 16, 32)
NEW_TOKENS = 5


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocab_adapters_after_warm_up_compile_nothing_and_match_peft(written_vocab, tied):
    base, rows = ("tied", TIED_ROWS) if tied else (None, UNTIED_ROWS)
    names = sorted({name for _, name in rows if name is not None})
    expected = {
        (tuple(p), name): hf_greedy(written_vocab[name if name else base][1], p, NEW_TOKENS) for p, name in rows
    }
    device = torch_xla.device()
    model = load_model(written_vocab[base][0], dtype=torch.float32, device=device)
    config = AdapterManagerConfig(max_slots=2, max_rank=MAX_RANK, device=device, prefetch_workers=0, lora_vocab=True)
    manager = AdapterManager(model.config.to_spec(TINY_NAME), config)
    for name in names:
        manager.register(str(written_vocab[name][0]), adapter_id=name)
    engine_config = EngineConfig(
        max_batch=4, max_seq_len=32, scheduler=SchedulerConfig(token_budget=32), token_buckets=BUCKETS, eos_ids=()
    )
    engine = Engine(model, manager, engine_config)
    try:
        manager.release(manager.acquire(names[:2]))  # every slot filled
        warm = engine.warm_up()
        assert warm > 0
        warmed = compile_count()
        rng = random.Random(1)
        handles = []
        for step in range(80):
            for _ in range(rng.choice((0, 1, 1, 2)) if step < 60 else 0):
                prompt, name = rng.choice(rows)
                handles.append((engine.submit(prompt, name, SamplingParams(max_tokens=NEW_TOKENS)), prompt, name))
            engine.step()
        engine.run_until_idle(max_steps=200)
        assert compile_count() == warmed, "a step after warm-up compiled"
        assert {name for _, _, name in handles} >= set(names)
        for handle, prompt, name in handles:
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
        assert manager.metrics().evictions["slot"] > 0
    finally:
        manager.close()
