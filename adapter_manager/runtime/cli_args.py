"""The command line's arguments that are more than a flag: byte sizes written as text, and the serving options
`serve` and `cluster serve` share (`runtime.options.ServeOptions` reads them). Light: no torch, no web stack."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from adapter_manager.base_model import MAX_RANK

from .client import TOKEN_ENV

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e6' -> bytes."""
    match = _SIZE.fullmatch(text.strip())
    unit = (match.group(2) or "").upper().removesuffix("B") if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MB, 1048576)")
    return int(float(match.group(1)) * _UNITS[unit])


def add_serving_options(parser: argparse.ArgumentParser, *, replica: bool) -> None:
    """The options `serve` and `cluster serve` share (with `replica`, sizes are each replica's); ServeOptions reads
    them."""
    each = " per replica" if replica else ""
    source = parser.add_mutually_exclusive_group(required=True)
    models = "(every replica loads it)" if replica else "or hub id org/name[@revision]"
    source.add_argument("model", nargs="?", help=f"checkpoint directory {models}")
    source.add_argument("--random", choices=("tiny", "bench"), help="write and serve a random-weight Llama instead")
    parser.add_argument("--model-name", default=None, help="the base model's name in API calls (default: the model)")
    parser.add_argument(
        "--max-slots",
        type=int,
        default=8,
        help=f"size the adapter pool{each} for this many max-rank adapters (default 8)",
    )
    parser.add_argument(
        "--max-rank", type=int, default=MAX_RANK, help=f"highest LoRA rank accepted, R (default {MAX_RANK})"
    )
    parser.add_argument(
        "--host-cache-bytes", type=parse_bytes, default="2GiB", help=f"host tier bound{each}, e.g. 2GiB (default)"
    )
    devices = "cpu or cuda" if replica else "cpu, cuda[:i] or xla[:i]"
    parser.add_argument("--device", default="cpu", help=f"{devices} (default cpu)")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help=f"shard the model and the adapter pool{each} over N devices (Megatron; XLA: one SPMD program) (1)",
    )
    parser.add_argument(
        "--fully-sharded-loras",
        action="store_true",
        help="with --tensor-parallel-size N: split every adapter's A and B N ways too (1/N of the pool per device, "
        "one all-reduce of the shrink output per linear; default: no LoRA collective; docs/engine.md)",
    )
    parser.add_argument("--max-batch", type=int, default=16, help=f"sequences in flight{each} (default 16)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="prompt + output tokens per sequence (2048)")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=512,
        help=f"tokens per engine step{each}: prefill chunks plus decode tokens (vLLM's --max-num-batched-tokens; 512)",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=parse_bytes,
        default=None,
        help=f"bytes of the KV block pool{each}, e.g. 4GiB (default: --max-batch sequences of --max-seq-len tokens, at "
        "most half the device's free memory); --max-batch stays a cap",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="every request's tokens and logprobs independent of what shares its batch (fixed-order matmuls on plain "
        "weights, attention per token; CPU and CUDA; costs speed: docs/engine.md)",
    )
    parser.add_argument(
        "--no-lora-vectors",
        dest="lora_vectors",
        action="store_false",
        help="no vector row per adapter slot (1/(2 x granule) of the pool's memory); DoRA and lora_bias adapters are "
        "then refused (default: served, docs/pool.md)",
    )
    parser.add_argument(
        "--lora-vocab",
        action="store_true",
        help="give every adapter row vocabulary columns (2 x (vocab + hidden) elements more per row): adapters with "
        "embed_tokens / lm_head LoRA or trainable tokens are then served (default: refused, docs/pool.md)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt from its first token (default: reuse cached prefix blocks per adapter)",
    )
    parser.add_argument(
        "--admin-token", default=os.environ.get(TOKEN_ENV), help=f"bearer token for admin routes (default ${TOKEN_ENV})"
    )
    tail = "" if replica else "; --adapter at start-up may name any directory"
    parser.add_argument(
        "--local-root",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"let the admin API register local directories under DIR (repeatable; default: hub ids only{tail})",
    )
