"""Shared fixtures: a tiny random HF Llama, real PEFT adapters written by `peft`, and their base model spec."""

from __future__ import annotations

import os

# No test may reach a real hub: anything that falls back to the default endpoint hits a closed loopback port.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ.pop("HF_TOKEN", None)
# Triton's interpreter (numpy on CPU tensors) where no GPU can run its kernels: Triton decorates its own helpers
# (tl.sum...) when first imported, so the mode is set here, before anything imports it; only the triton backend reads
# it (AUTO never picks that backend on a CPU device). With a GPU the kernels are compiled (tests/*/test_cuda.py).
if "TRITON_INTERPRET" not in os.environ and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# The tests name each weight layout they exercise; a model loaded without one keeps the blocked layout here, as the
# suite was written for, instead of measuring on the machine (tests/kernels/cpu/test_layout_choice.py sets auto).
os.environ.setdefault("ADAPTER_MANAGER_WEIGHT_LAYOUT", "blocked")

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from adapter_manager import BaseModelSpec

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=64,
)
TINY_NAME = "test-org/tiny-llama"
# PEFT LoRA configs that the prepare test and the runtime oracle both write: two targets; every linear with rsLoRA;
# per-module rank and alpha patterns (a plain key, a full module name, a regex)
QV_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
ALL_LINEAR_RSLORA = dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear")
PATTERNS_LORA = dict(
    r=4,
    lora_alpha=4,
    target_modules=["q_proj", "k_proj", "o_proj", "down_proj", "gate_proj"],
    rank_pattern={"k_proj": 2, "model.layers.1.self_attn.o_proj": 8},
    alpha_pattern={"down_proj": 32, r"layers\.2\.self_attn\.q_proj": 3},
)


@pytest.fixture(scope="session")
def tiny_spec() -> BaseModelSpec:
    return BaseModelSpec.from_hf_config(TINY, name=TINY_NAME)


def make_tiny_llama(seed: int = 0, tie: bool = False):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)
    config._name_or_path = TINY_NAME
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def write_peft_adapter(tmp_path: Path) -> Callable[..., tuple[Path, object]]:
    """Write a real PEFT adapter: get_peft_model on the tiny Llama with random A and B, then save_pretrained.

    Returns (folder, peft_model) so tests can compare with PEFT's own delta weights.
    """
    peft = pytest.importorskip("peft")
    counter = iter(range(1_000_000))

    def write(folder: Path | None = None, seed: int = 0, **lora_kwargs) -> tuple[Path, object]:
        folder = folder or tmp_path / f"peft-adapter-{next(counter)}"
        lora_kwargs.setdefault("r", 4)
        lora_kwargs.setdefault("lora_alpha", 8)
        lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
        config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
        torch.manual_seed(seed)
        model = peft.get_peft_model(make_tiny_llama(), config)
        model.save_pretrained(folder, save_embedding_layers=False)
        return folder, model

    return write


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter for the Triton backends a test builds (``TRITON_INTERPRET=1`` while it runs). Skips where
    triton is not installed (the 'triton' extra) or was imported for a GPU (the compiled kernels' tests run there)."""
    pytest.importorskip("triton", reason="triton is not installed (the 'triton' extra)")
    from adapter_manager.kernels.triton.kernels import imported_interpreting

    if not imported_interpreting():
        pytest.skip("triton was imported compiled (a GPU is present): its kernels are tested in test_cuda.py")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
