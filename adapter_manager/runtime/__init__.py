"""Runtime: ``model/`` (the batched Llama), ``engine/`` (continuous batching), ``server/`` (HTTP), and the door:
``cli``, ``client`` (a stdlib HTTP client of the server) and ``demo``.

Importing ``runtime`` or ``runtime.engine`` pulls in no web stack; ``runtime.server`` brings FastAPI and uvicorn. The
names below load on first use (PEP 562), as the package root's do: ``runtime.cli`` starts before torch loads.
"""

# ruff: noqa: F401 - the imports under TYPE_CHECKING are for type checkers; the names load lazily below
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_names import lazy_names

if TYPE_CHECKING:
    from .engine import Engine, EngineConfig, SamplingParams
    from .model import Llama, LlamaConfig, load_checkpoint, load_model, load_tokenizer, write_random_checkpoint

_EXPORTS: dict[str, tuple[str, ...]] = {  # submodule -> the names it gives the package
    "engine": ("Engine", "EngineConfig", "SamplingParams"),
    "model": ("Llama", "LlamaConfig", "load_checkpoint", "load_model", "load_tokenizer", "write_random_checkpoint"),
}
__all__, __getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
