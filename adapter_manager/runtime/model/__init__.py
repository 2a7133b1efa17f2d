"""The batched Llama: config, RoPE, KV cache, LoRA linears over the slot stacks, HF checkpoints, tokenizers."""

from .batch import ForwardBatch, SeqSpan, SequenceChunk, StaticPadding
from .checkpoint import CheckpointError, CheckpointSource, load_checkpoint, load_model, write_random_checkpoint
from .config import LlamaConfig, RopeScaling
from .kv_cache import KVCache
from .llama import Llama
from .projection import LoRALinear
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
    "StaticPadding",
    "Tokenizer",
    "load_checkpoint",
    "load_model",
    "load_tokenizer",
    "write_random_checkpoint",
]
