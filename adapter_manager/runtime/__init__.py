"""Runtime: ``model/`` (the batched Llama), ``engine/`` (continuous batching), ``server/`` (HTTP), and the door:
``cli``, ``client`` (a stdlib HTTP client of the server) and ``demo``.

Importing ``runtime`` or ``runtime.engine`` pulls in no web stack; ``runtime.server`` brings FastAPI and uvicorn.
"""

from .engine import Engine, EngineConfig, SamplingParams
from .model import Llama, LlamaConfig, load_checkpoint, load_model, load_tokenizer, write_random_checkpoint

__all__ = [
    "Engine",
    "EngineConfig",
    "Llama",
    "LlamaConfig",
    "SamplingParams",
    "load_checkpoint",
    "load_model",
    "load_tokenizer",
    "write_random_checkpoint",
]
