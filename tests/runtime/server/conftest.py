"""Server fixtures: a random tiny checkpoint per module, served on 127.0.0.1 by a background server, and an `openai`
client for the module's `server` fixture."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from adapter_manager import AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.model.checkpoint import write_random_checkpoint
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.server.app import BackgroundServer
from adapter_manager.runtime.server.launch import Serving, build_serving
from adapter_manager.runtime.server.state import ServerConfig

NAME = "tiny-base"  # the served base model
CONFIG = LlamaConfig.tiny()


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> Path:
    """A folder with the random tiny checkpoint at model/; the module writes its adapters beside it."""
    root = tmp_path_factory.mktemp("server")
    write_random_checkpoint(CONFIG, root / "model")
    return root


@contextmanager
def serving_on(
    model: Path,
    manager: AdapterManagerConfig,
    engine: EngineConfig,
    server: ServerConfig,
    adapters: Mapping[str, Path] | None = None,
) -> Iterator[tuple[Serving, BackgroundServer]]:
    """`build_serving` on the checkpoint folder ``model``, ``adapters`` (id -> folder) registered, then a started
    background server; on exit the server stops and the serving closes."""
    serving = build_serving(model, manager, engine, server)
    for adapter_id, folder in (adapters or {}).items():
        serving.manager.register(str(folder), adapter_id)
    background = BackgroundServer(serving.app).start()
    try:
        yield serving, background
    finally:
        background.stop()
        serving.close()


@pytest.fixture(scope="module")
def server(checkpoint_root):
    """A plain tiny server (no adapter, 2 slots of rank 16); modules that need more define their own."""
    with serving_on(
        checkpoint_root / "model",
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=16)),
        EngineConfig(max_batch=4, max_seq_len=64),
        ServerConfig(model_name=NAME, port=0, max_pending=16),
    ) as started:
        yield started


@pytest.fixture
def client(server):
    """The official `openai` client on the module's `server` (serving, background)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)
