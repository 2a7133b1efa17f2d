"""From a checkpoint folder to a served app: model, adapter manager, engine, tokenizer, chat template, app.

Used by ``adapter-manager serve``, the demo and the server tests, so all three build the same thing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from fastapi import FastAPI

from adapter_manager import AdapterManager, AdapterManagerConfig

from ..engine.engine import Engine, EngineConfig
from ..engine.shard_workers import ShardLaunch, ShardWorkers, start_shard_workers
from ..model.checkpoint import load_model
from ..model.shard_plan import shard_form
from ..model.tokenizer import load_tokenizer
from .app import create_app
from .chat_template import ChatTemplate
from .state import ServerConfig

log = logging.getLogger(__name__)


@dataclass
class Serving:
    """What `build_serving` made; `close()` when the server has stopped."""

    app: FastAPI
    engine: Engine
    manager: AdapterManager
    shards: ShardWorkers | None = None  # the other tensor-parallel shards' processes (cpu, tensor_parallel_size > 1)

    def close(self) -> None:
        self.engine.close()
        self.manager.close()
        if self.shards is not None:
            self.shards.close()


def build_serving(
    folder: str | Path,
    manager_config: AdapterManagerConfig,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    dtype: torch.dtype = torch.float32,
    model_ref: str | None = None,
    quantize: str | None = None,
) -> Serving:
    """Load the checkpoint in `folder` onto `manager_config.device` and build the app around it. The engine's
    max_seq_len is capped at the model's max_position_embeddings; on a traced device (XLA) the engine is warmed up
    before the app exists, so requests compile nothing. The chat template is the checkpoint's own if it has one.
    Adapters are checked against the checkpoint's identity (:func:`checkpoint_aliases`: its folder, and the hub id
    or path `model_ref` it was served from) as well as the served name `server_config.model_name`. `quantize`
    ("int8") holds the base projections weight-only int8 (:func:`runtime.model.checkpoint.load_model`)."""
    folder = Path(folder)
    tp, device, shards = manager_config.rows.tensor_parallel, manager_config.device, None
    if shard_form(tp.size, device) == "processes":  # one process per shard, this one rank 0
        shards = start_shard_workers(ShardLaunch(folder, tp, dtype, str(device), quantize=quantize))
        model = shards.load_model()
    else:
        plain = False if engine_config.deterministic else None  # the mode reads plain weights: none packed
        model = load_model(folder, dtype, device, pack_weights=plain, quantize=quantize, tensor_parallel=tp)
    try:
        max_seq_len = min(engine_config.max_seq_len, model.config.max_position_embeddings)
        engine_config = replace(engine_config, max_seq_len=max_seq_len)
        spec = model.config.to_spec(server_config.model_name, checkpoint_aliases(folder, model_ref))
        manager = AdapterManager(spec, manager_config)
        engine = Engine(model, manager, engine_config)
        started = time.perf_counter()
        if graphs := engine.warm_up():  # traced devices: every step graph now, none on the first requests
            log.info("warm-up: %d step graphs compiled in %.1f s", graphs, time.perf_counter() - started)
        tokenizer = load_tokenizer(folder, model.config.vocab_size)
        server_config = replace(server_config, chat_template=ChatTemplate.from_folder(folder))
    except BaseException:
        if shards is not None:  # their processes and the process group go with the failed start
            shards.close()
        raise
    return Serving(create_app(engine, manager, tokenizer, server_config), engine, manager, shards)


def checkpoint_aliases(folder: str | Path, model_ref: str | None = None) -> tuple[str, ...]:
    """What an adapter trained on this checkpoint may name as its base model: the resolved folder, and the ref it
    was served from (a local path, expanded; a hub id ``org/name@revision`` and ``org/name``).

    Example: ``checkpoint_aliases("/ckpt/snap/abc", "org/llama@v2")`` -> ``("/ckpt/snap/abc", "org/llama@v2",
    "org/llama")``."""
    names = [str(Path(folder).resolve())]
    if model_ref:
        local = Path(model_ref.removeprefix("file://")).expanduser()
        if local.is_dir():
            names.append(str(local.resolve()))
        names += [model_ref, model_ref.partition("@")[0]]
    return tuple(dict.fromkeys(names))
