"""What a benchmark leaves behind: its JSON file, and the machine it ran on (every CPU figure names its CPU: a
choice tuned on one kind can lose on another)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adapter_manager import kernels

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
"""The /proc/cpuinfo flags the CPU kernels' choices depend on."""


def cpu_model() -> str:
    """The CPU's model name (``platform.processor()`` where /proc/cpuinfo has none)."""
    return kernels.cpu_model()


def cpu_features() -> dict[str, object]:
    """The machine description a CPU figure carries: model, the ISA flags that matter, torch's view of them."""
    flags = kernels.cpu_flags() or frozenset()
    return {
        "model": cpu_model(),
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "native_bf16": kernels.has_fast_bf16(flags),
        "amx": "amx_tile" in flags,
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def write_json(
    path: Path | str,
    payload: object,
    *,
    indent: int | None = 2,
    default: Callable[[Any], Any] | None = None,
    prefix: str = "",
) -> Path:
    """Write ``payload`` as JSON to ``path`` (its folder made first) and print ``{prefix}wrote {path}``.

    ``indent`` and ``default`` as in :func:`json.dumps` (None: one line; ``default=float`` for numpy scalars)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=default))
    print(f"{prefix}wrote {path}")
    return path
