"""Runtime fixtures: the tiny base checkpoint with PEFT adapters (and their PeftModels), HF generate's outputs, and
an engine serving them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.llama import Llama
from tests.conftest import TINY_NAME, make_tiny_llama
from tests.runtime._oracle import ADAPTERS, ENGINE_NEW_TOKENS, ENGINE_REQUESTS, hf_greedy, write_adapter
from tests.runtime._variants import VARIANTS, write_trained
from tests.runtime._vocab import write_vocab_adapters


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> dict[str | None, tuple[Path, object]]:
    """Every adapter written by peft, with its PeftModel; the None entry is the base model and its checkpoint."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-oracle")
    out: dict[str | None, tuple[Path, object]] = {
        name: write_adapter(root / name, seed=i + 1, **kwargs) for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    base = make_tiny_llama()
    base.save_pretrained(root / "base")
    out[None] = (root / "base", base)
    return out


@pytest.fixture(scope="session")
def written_variants(tmp_path_factory, written) -> dict[str | None, tuple[Path, object]]:
    """The variant adapters (`tests.runtime._variants`) trained and written by peft, with their PeftModels; the None
    entry is the base model and its checkpoint (the same as `written`'s)."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("variant-oracle")
    out = {name: write_trained(root / name, seed=i + 11, **kw) for i, (name, kw) in enumerate(VARIANTS.items())}
    out[None] = written[None]
    return out


@pytest.fixture(scope="session")
def written_vocab(tmp_path_factory) -> dict:
    """The vocabulary adapters (`tests.runtime._vocab`) trained and written by peft, with their PeftModels; None:
    the untied base, "tied": the tied base (folder, HF model)."""
    return write_vocab_adapters(tmp_path_factory.mktemp("vocab-oracle"))


@pytest.fixture(scope="session")
def expected(written) -> dict[tuple[tuple[int, ...], str | None], list[int]]:
    """HF generate, greedy, one adapter at a time: the oracle for every (prompt, adapter) the engine tests serve."""
    return {(tuple(p), name): hf_greedy(written[name][1], p, ENGINE_NEW_TOKENS) for p, name in ENGINE_REQUESTS}


@pytest.fixture
def make_engine(written) -> Callable[..., tuple[Engine, AdapterManager]]:
    """Build (engine, manager) on the base checkpoint with the oracle's adapters registered (the test closes both).

    eos_ids=() as the oracle's generate runs with no eos; None takes the checkpoint's. ``model`` replaces the fp32 CPU
    model loaded from ``checkpoint`` (default: the base checkpoint); ``engine_kwargs`` go to `EngineConfig`, the other
    keywords to `AdapterManagerConfig`; ``source``: the adapters (and base checkpoint) to serve, default `written`.
    """

    def make(
        max_slots: int = 2,
        token_budget: int = 12,
        max_batch: int = 4,
        eos_ids: tuple[int, ...] | None = (),
        checkpoint: Path | None = None,
        model: Llama | None = None,
        adapters: Iterable[str] = tuple(ADAPTERS),
        engine_kwargs: dict | None = None,
        source: dict[str | None, tuple[Path, object]] | None = None,
        **manager_kwargs,
    ) -> tuple[Engine, AdapterManager]:
        source = source or written
        if model is None:
            model = load_model(checkpoint or source[None][0], dtype=torch.float32)
        spec = model.config.to_spec(TINY_NAME)
        manager_kwargs.setdefault("rows", RowOptions(max_rank=8))
        manager = AdapterManager(spec, AdapterManagerConfig(max_slots=max_slots, **manager_kwargs))
        for name in adapters:
            manager.register(str(source[name][0]), adapter_id=name)
        scheduler = SchedulerConfig(token_budget=token_budget)
        config = EngineConfig(
            max_batch=max_batch, max_seq_len=64, scheduler=scheduler, eos_ids=eos_ids, **(engine_kwargs or {})
        )
        return Engine(model, manager, config), manager

    return make
