"""Batched Llama runtime with LoRA linears, HF checkpoint loading, tokenizers, the CLI and the demo."""

from .batch import ForwardBatch, SeqSpan, SequenceChunk
from .checkpoint import CheckpointError, CheckpointSource, load_checkpoint, load_model, write_random_checkpoint
from .config import LlamaConfig, RopeScaling
from .kv_cache import KVCache
from .lora_linear import LoRALinear
from .model import Llama
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
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
    "Tokenizer",
    "load_checkpoint",
    "load_model",
    "load_tokenizer",
    "write_random_checkpoint",
]
