"""Runtime: ``model/`` (the batched Llama), ``engine/`` (continuous batching), ``server/`` (HTTP), and the door:
``cli``, ``client`` (a stdlib HTTP client of the server) and ``demo``.

Importing ``runtime`` or ``runtime.engine`` pulls in no web stack; ``runtime.server`` brings FastAPI and uvicorn. The
names below load on first use (PEP 562), as the package root's do: ``runtime.cli`` starts before torch loads.
"""

# ruff: noqa: F401 - the imports under TYPE_CHECKING are for type checkers; the names load lazily below
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine, EngineConfig, SamplingParams
    from .model import Llama, LlamaConfig, load_checkpoint, load_model, load_tokenizer, write_random_checkpoint

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the names it gives the package
    "engine": ("Engine", "EngineConfig", "SamplingParams"),
    "model": ("Llama", "LlamaConfig", "load_checkpoint", "load_model", "load_tokenizer", "write_random_checkpoint"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
