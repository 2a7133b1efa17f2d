"""The serving options `serve`, `cluster serve` and the demo share, the command line made from them, and the one
builder that turns them into the adapter pool's, the engine's and the HTTP server's configs.

Each option is declared once, as a field whose ``metadata`` is its flag (`runtime.cli_args`), here or in the
lifecycle object it travels in whole (``RowOptions``: ``--max-rank``, ``--tensor-parallel-size``,
``--fully-sharded-loras``, ``--no-lora-vectors``, ``--lora-vocab``). A new option is one field there and the code that
acts on it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from adapter_manager import AdapterManagerConfig, RowOptions

from .cli_args import add_options, options_from, parse_bytes
from .client import TOKEN_ENV
from .engine.engine import EngineConfig
from .engine.scheduler import SchedulerConfig
from .model.checkpoint import DTYPE_CHOICES, QUANTIZE_CHOICES, check_quantize, resolve_dtype, write_random_checkpoint
from .model.config import LlamaConfig

if TYPE_CHECKING:
    from .server.state import ServerConfig  # the web stack: loaded only by `configs`


def _default(cls: type, name: str) -> Any:
    """The default of ``cls``'s field ``name``: a serve option's default is the config's it goes to, written there."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _roots(roots: list[Path] | None) -> tuple[Path, ...] | None:
    return tuple(roots) if roots else None


@dataclass(frozen=True)
class ServingConfigs:
    """What one server, or each replica of a cluster, runs with."""

    manager: AdapterManagerConfig  # the adapter pool and its tiers
    engine: EngineConfig  # continuous batching
    server: ServerConfig  # the API: model name, where it listens, admin token, local roots
    dtype: torch.dtype  # the base model's serving dtype
    quantize: str | None = None  # the base weights' quantization: None (as loaded) or "int8"


@dataclass(frozen=True)
class ServeOptions:
    """The options a server runs with, with the CLI's defaults: `serve` sets them all, `cluster serve` all but the
    ``serve_only`` ones (its replicas keep their defaults). `configs` is the one builder of the configs."""

    model_name: str  # the base model's name in API calls
    max_slots: int = field(
        default=_default(AdapterManagerConfig, "max_slots"),
        metadata={"flag": "--max-slots", "help": "size the adapter pool{each} for this many max-rank adapters "
                  "(default %(default)s)"},
    )  # fmt: skip
    rows: RowOptions = field(default_factory=RowOptions)  # R, N-way tensor parallelism, vector and vocab columns
    host_cache_bytes: int = field(
        default=_default(AdapterManagerConfig, "host_cache_bytes"),
        metadata={"flag": "--host-cache-bytes", "type": parse_bytes,
                  "help": "host tier bound{each}, e.g. %(default)s (default)"},
    )  # fmt: skip
    device: str = field(
        default=_default(AdapterManagerConfig, "device"),
        metadata={"flag": "--device", "help": "{devices} (default %(default)s)"},
    )  # cpu, cuda[:i] or xla[:i]
    max_batch: int = field(
        default=_default(EngineConfig, "max_batch"),
        metadata={"flag": "--max-batch", "help": "sequences in flight{each} (default %(default)s)"},
    )
    max_seq_len: int = field(
        default=_default(EngineConfig, "max_seq_len"),
        metadata={"flag": "--max-seq-len", "help": "prompt + output tokens per sequence (%(default)s)"},
    )
    token_budget: int = field(
        default=_default(SchedulerConfig, "token_budget"),
        metadata={"flag": "--token-budget", "help": "tokens per engine step{each}: prefill chunks plus decode tokens "
                  "(vLLM's --max-num-batched-tokens; %(default)s)"},
    )  # fmt: skip
    kv_cache_bytes: int | None = field(
        default=_default(EngineConfig, "kv_cache_bytes"),
        metadata={"flag": "--kv-cache-bytes", "type": parse_bytes,
                  "help": "bytes of the KV block pool{each}, e.g. 4GiB (default: --max-batch sequences of "
                  "--max-seq-len tokens, at most half the device's free memory); --max-batch stays a cap"},
    )  # fmt: skip
    deterministic: bool = field(
        default=_default(EngineConfig, "deterministic"),
        metadata={"flag": "--deterministic", "help": "every request's tokens and logprobs independent of what shares "
                  "its batch (fixed-order matmuls on plain weights, attention per token; CPU and CUDA; costs speed: "
                  "docs/engine.md)"},
    )  # fmt: skip
    prefix_caching: bool = field(
        default=_default(EngineConfig, "prefix_caching"),
        metadata={"flag": "--no-prefix-caching", "dest": "prefix_caching", "help": "compute every prompt from its "
                  "first token (default: reuse cached prefix blocks per adapter)"},
    )  # fmt: skip
    admin_token: str | None = field(
        default=None,
        metadata={"flag": "--admin-token", "env": TOKEN_ENV,
                  "help": f"bearer token for admin routes (default ${TOKEN_ENV})"},
    )  # fmt: skip
    local_roots: tuple[Path, ...] | None = field(
        default=None,
        metadata={"flag": "--local-root", "action": "append", "type": Path, "metavar": "DIR", "to_field": _roots,
                  "help": "let the admin API register local directories under DIR (repeatable; default: hub ids "
                  "only{tail})"},
    )  # fmt: skip
    pool_bytes: int | None = field(
        default=None,
        metadata={"flag": "--pool-bytes", "type": parse_bytes, "serve_only": True,
                  "help": "size the adapter pool in bytes instead, e.g. 1GiB"},
    )  # fmt: skip
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata={"flag": "--dtype", "choices": DTYPE_CHOICES, "serve_only": True,
                  "help": "serving dtype (auto: the checkpoint's torch_dtype, float32 where it names none)"},
    )  # fmt: skip
    quantize: Literal["none", "int8"] = field(
        default="none",
        metadata={"flag": "--quantize", "choices": QUANTIZE_CHOICES, "serve_only": True,
                  "help": "int8: hold the base model's projection weights (and an untied lm_head) weight-only int8, "
                  "one scale per output row; adapters stay in the serving dtype"},
    )  # fmt: skip
    max_pending: int = field(
        default=256,
        metadata={"flag": "--max-pending", "serve_only": True,
                  "help": "requests in flight before 503 (default %(default)s)"},
    )  # fmt: skip
    host: str = field(
        default="127.0.0.1",
        metadata={"flag": "--host", "serve_only": True,
                  "help": "bind address (default %(default)s; others need a token)"},
    )  # fmt: skip
    port: int = field(
        default=8000,
        metadata={"flag": "--port", "serve_only": True, "help": "port (default %(default)s; 0 picks a free one)"},
    )
    state_dir: Path | None = field(
        default=None,
        metadata={"flag": "--state-dir", "type": Path, "metavar": "DIR", "serve_only": True,
                  "help": "keep registrations durably in DIR (sqlite3) and restore them at start from the HF cache, "
                  "offline"},
    )  # fmt: skip
    disk_cache_bytes: int | None = field(
        default=None,
        metadata={"flag": "--disk-cache-bytes", "type": parse_bytes, "serve_only": True,
                  "help": "bound the adapter files in the HF cache, e.g. 10GiB (least recently used revisions "
                  "evicted)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        check_quantize(self.quantize)

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_name: str, *, replica: bool = False) -> ServeOptions:
        """The options `serve` parsed into `args`, or with `replica` those `cluster serve` declares."""
        return options_from(cls, args, replica=replica, model_name=model_name)

    def configs(self, folder: Path | None = None) -> ServingConfigs:
        """The configs of the adapter pool, the engine and the HTTP server; dtype ``auto`` is the one the checkpoint
        in ``folder`` names (:func:`runtime.model.checkpoint.resolve_dtype`: float32 where it names none)."""
        from .server.state import ServerConfig

        dtype = resolve_dtype(folder, self.dtype)
        manager = AdapterManagerConfig(
            max_slots="auto" if self.pool_bytes else self.max_slots,
            rows=self.rows,
            host_cache_bytes=self.host_cache_bytes,
            device=self.device,
            dtype=dtype,
            slot_memory_bytes=self.pool_bytes,
            state_dir=self.state_dir,
            disk_cache_bytes=self.disk_cache_bytes,
        )
        server = ServerConfig(
            self.model_name,
            host=self.host,
            port=self.port,
            admin_token=self.admin_token,
            max_pending=self.max_pending,
            local_roots=self.local_roots,
        )
        scheduler = SchedulerConfig(token_budget=self.token_budget)
        engine = EngineConfig(
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            scheduler=scheduler,
            kv_cache_bytes=self.kv_cache_bytes,
            prefix_caching=self.prefix_caching,
            deterministic=self.deterministic,
        )
        return ServingConfigs(manager, engine, server, dtype, check_quantize(self.quantize))


def add_serving_options(parser: argparse.ArgumentParser, *, replica: bool) -> None:
    """The model to serve and every `ServeOptions` field's flag (with `replica`, `cluster serve`'s: no serve-only
    ones, and sizes are each replica's); :meth:`ServeOptions.from_args` reads them back."""
    source = parser.add_mutually_exclusive_group(required=True)
    models = "(every replica loads it)" if replica else "or hub id org/name[@revision]"
    source.add_argument("model", nargs="?", help=f"checkpoint directory {models}")
    source.add_argument("--random", choices=("tiny", "bench"), help="write and serve a random-weight Llama instead")
    parser.add_argument("--model-name", default=None, help="the base model's name in API calls (default: the model)")
    add_options(
        parser,
        ServeOptions,
        replica=replica,
        each=" per replica" if replica else "",
        devices="cpu or cuda" if replica else "cpu, cuda[:i] or xla[:i]",
        tail="" if replica else "; --adapter at start-up may name any directory",
    )


def model_source(args: argparse.Namespace, random_root: Path, resolve: Callable[[str], Path]) -> tuple[Path, str]:
    """The checkpoint folder to serve and the base model's name in API calls: with ``--random`` a random Llama
    written under `random_root`, else ``resolve(args.model)``; ``--model-name`` overrides the name."""
    if args.random:
        folder = random_root / f"random-{args.random}"
        write_random_checkpoint(getattr(LlamaConfig, args.random)(), folder)
        return folder, args.model_name or f"random-{args.random}"
    return resolve(args.model), args.model_name or args.model
