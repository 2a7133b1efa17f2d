"""Shared oracle material for the runtime tests: real PEFT adapters on the tiny Llama and the rows that use them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import ALL_LINEAR_RSLORA, PATTERNS_LORA, QV_LORA, make_tiny_llama

FP32_TOL = 1e-4
BF16_ATOL, BF16_RTOL = 1e-2, 5e-2
MAX_RANK = 8
NEW_TOKENS = 8
ADAPTERS = {
    "qv": QV_LORA,
    "all_rslora": ALL_LINEAR_RSLORA,
    "patterns": PATTERNS_LORA,
    "mlp_subset": dict(r=2, lora_alpha=5, target_modules=["up_proj", "k_proj"], layers_to_transform=[0, 2]),
    "spare": dict(r=6, lora_alpha=12, target_modules=["v_proj", "down_proj", "o_proj"]),
}
SLOTTED = ("qv", "all_rslora", "patterns", "mlp_subset")  # "spare" is swapped in later
# (prompt, adapter or None): ragged lengths, no-adapter rows between adapter rows, one adapter on two rows
ROWS = [
    ([1, 5, 9, 3, 7, 11], "qv"),
    ([2, 8, 33], None),
    ([4, 60, 4, 33, 4, 17, 4, 9, 12], "all_rslora"),
    ([7, 1], "patterns"),
    ([30, 31, 32, 33, 34], "mlp_subset"),
    ([9, 9, 40, 2], None),
    ([50, 3, 8, 12], "patterns"),
]


def write_adapter(folder: Path, seed: int, **lora_kwargs) -> tuple[Path, object]:
    """Random A and B on the tiny Llama (as the `write_peft_adapter` fixture), saved by peft."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    torch.manual_seed(seed)
    model = peft.get_peft_model(make_tiny_llama(), config).eval()
    model.save_pretrained(folder, save_embedding_layers=False)
    return folder, model


def oracle_logits(written, name: str | None, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return written[name][1](input_ids=torch.tensor([ids])).logits[0].float()  # [len, vocab]


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """HF `generate` (an HF or PEFT model), greedy, no eos: the tokens after ``prompt``; the oracle of a generation."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def slots_of(adapters: list[str | None], layout: tuple[str, ...]) -> list[int]:
    return [-1 if name is None else layout.index(name) for name in adapters]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


ENGINE_NEW_TOKENS = 6  # tokens the engine tests generate per request
ENGINE_REQUESTS = ROWS + [([3, 1, 4, 1, 5], name) for name in ADAPTERS]  # every (prompt, adapter) `expected` holds


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_dequantized(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-row int8 of w, dequantized: the weights the int8 model stands for."""
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-127, 127) * scale


def int8_copy(hf):
    """A copy of an HF (or PEFT) model whose projections' base weights and untied lm_head are int8-dequantized;
    embeddings, norms and any LoRA weights as they were."""
    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            projection = ".layers." in name and any(f".{p}." in name for p in PROJECTIONS)
            if "lora_" not in name and (projection or name.endswith("lm_head.weight")):
                param.copy_(int8_dequantized(param))
    return hf


def int8_generate(written, requests) -> dict[tuple[tuple[int, ...], str | None], list[int]]:
    """HF / PEFT greedy generate on the int8-dequantized base (:func:`int8_copy`), one adapter at a time: the oracle of
    an int8 engine for each (prompt, adapter) of ``requests``."""
    copies, result = {}, {}
    for prompt, name in requests:
        if name not in copies:
            copies[name] = int8_copy(written[name][1])
            copies[name].generation_config.eos_token_id = None
        with torch.no_grad():
            out = copies[name].generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=ENGINE_NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        result[(tuple(prompt), name)] = out[0, len(prompt) :].tolist()
    return result
