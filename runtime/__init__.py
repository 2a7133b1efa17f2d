"""Batched Llama runtime with LoRA linears, checkpoints, tokenizers, the HTTP server, the CLI and the demo."""

from .batch import ForwardBatch, SeqSpan, SequenceChunk
from .chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from .checkpoint import CheckpointError, CheckpointSource, load_checkpoint, load_model, write_random_checkpoint
from .config import LlamaConfig, RopeScaling
from .kv_cache import KVCache
from .launch import Serving, build_serving
from .lora_linear import LoRALinear
from .model import Llama
from .server import BackgroundServer, create_app, serve
from .server_client import ServerClient, ServerError
from .server_state import ServerConfig
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "BackgroundServer",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "CheckpointError",
    "CheckpointSource",
    "ForwardBatch",
    "HFTokenizer",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "LoRALinear",
    "RopeScaling",
    "SeqSpan",
    "SequenceChunk",
    "ServerClient",
    "ServerConfig",
    "ServerError",
    "Serving",
    "Tokenizer",
    "build_serving",
    "create_app",
    "load_checkpoint",
    "load_model",
    "load_tokenizer",
    "serve",
    "write_random_checkpoint",
]
