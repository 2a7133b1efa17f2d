"""The serving options `serve`, `cluster serve` and the demo share, and the one builder that turns them into the
adapter pool's, the engine's and the HTTP server's configs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from adapter_manager import AdapterManagerConfig
from adapter_manager.base_model import MAX_RANK

from .engine.engine import EngineConfig
from .engine.scheduler import SchedulerConfig
from .model.checkpoint import DTYPE_CHOICES, check_quantize, resolve_dtype, write_random_checkpoint
from .model.config import LlamaConfig
from .server.state import ServerConfig

_GIB = 1 << 30
# namespace attributes ServeOptions reads: those both commands declare, and those only `serve` has
_SHARED = (
    "max_slots", "max_rank", "host_cache_bytes", "device", "max_batch", "max_seq_len", "token_budget", "admin_token",
    "kv_cache_bytes", "prefix_caching", "tensor_parallel_size", "deterministic", "lora_vectors",
    "lora_vocab", "fully_sharded_loras",
)  # fmt: skip
_SERVE_ONLY = ("pool_bytes", "dtype", "quantize", "state_dir", "disk_cache_bytes", "host", "port", "max_pending")


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
    """The options a server runs with, with the CLI's defaults: `serve` sets them all, `cluster serve` the shared
    ones (its replicas keep the defaults of the serve-only rest). `configs` is the one builder of the configs."""

    model_name: str  # the base model's name in API calls
    max_slots: int = 8  # the adapter pool holds this many max-rank adapters
    max_rank: int = MAX_RANK  # R: the highest LoRA rank accepted
    host_cache_bytes: int = 2 * _GIB  # host tier bound
    device: str = "cpu"  # cpu, cuda[:i] or xla[:i]
    max_batch: int = 16  # sequences in flight
    max_seq_len: int = 2048  # prompt + output tokens per sequence
    token_budget: int = 512  # tokens per engine step: prefill chunks plus decode tokens
    admin_token: str | None = None  # bearer token for the admin routes
    kv_cache_bytes: int | None = None  # bytes of the KV block pool; None: max_batch sequences of max_seq_len
    prefix_caching: bool = True  # reuse cached prefix blocks per adapter
    tensor_parallel_size: int = 1  # N: the model and the adapter pool sharded over N devices (vLLM's name)
    fully_sharded_loras: bool = False  # N > 1: every A and Bt split too (AdapterManagerConfig's; vLLM's name)
    deterministic: bool = False  # a request's tokens and logprobs independent of its batch (EngineConfig's)
    lora_vectors: bool = True  # a vector row per slot: DoRA and lora_bias adapters served (AdapterManagerConfig's)
    lora_vocab: bool = False  # vocabulary columns: embedding / lm_head LoRA, trainable tokens (AdapterManagerConfig's)
    local_roots: tuple[Path, ...] | None = None  # dirs the admin API may register from; None: hub ids only
    pool_bytes: int | None = None  # serve only: size the adapter pool in bytes instead of max_slots
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # serve only: auto is the checkpoint's
    quantize: Literal["none", "int8"] = "none"  # serve only: int8 holds the block projections weight-only int8
    state_dir: Path | None = None  # serve only: the manager's durable registrations (a cluster's are the directory's)
    disk_cache_bytes: int | None = None  # serve only: bound of the adapter files in the HF cache
    host: str = "127.0.0.1"  # serve only: bind address (Serve listens for a cluster)
    port: int = 8000  # serve only: port
    max_pending: int = 256  # serve only: requests in flight before 503

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        check_quantize(self.quantize)

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_name: str, *, replica: bool = False) -> ServeOptions:
        """The options `serve` parsed into `args`, or with `replica` those `cluster serve` shares with it."""
        names = _SHARED if replica else _SHARED + _SERVE_ONLY
        local_roots = tuple(args.local_root) if args.local_root else None
        return cls(model_name, local_roots=local_roots, **{name: getattr(args, name) for name in names})

    def configs(self, folder: Path | None = None) -> ServingConfigs:
        """The configs of the adapter pool, the engine and the HTTP server; dtype ``auto`` is the one the checkpoint
        in ``folder`` names (:func:`runtime.model.checkpoint.resolve_dtype`: float32 where it names none)."""
        dtype = resolve_dtype(folder, self.dtype)
        manager = AdapterManagerConfig(
            max_slots="auto" if self.pool_bytes else self.max_slots,
            max_rank=self.max_rank,
            host_cache_bytes=self.host_cache_bytes,
            device=self.device,
            dtype=dtype,
            slot_memory_bytes=self.pool_bytes,
            state_dir=self.state_dir,
            disk_cache_bytes=self.disk_cache_bytes,
            tensor_parallel_size=self.tensor_parallel_size,
            lora_vectors=self.lora_vectors,
            lora_vocab=self.lora_vocab,
            fully_sharded_loras=self.fully_sharded_loras,
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


def model_source(args: argparse.Namespace, random_root: Path, resolve: Callable[[str], Path]) -> tuple[Path, str]:
    """The checkpoint folder to serve and the base model's name in API calls: with ``--random`` a random Llama
    written under `random_root`, else ``resolve(args.model)``; ``--model-name`` overrides the name."""
    if args.random:
        folder = random_root / f"random-{args.random}"
        write_random_checkpoint(getattr(LlamaConfig, args.random)(), folder)
        return folder, args.model_name or f"random-{args.random}"
    return resolve(args.model), args.model_name or args.model
