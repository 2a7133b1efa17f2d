"""Runtime fixtures: the tiny base checkpoint with PEFT adapters (and their PeftModels), HF generate's outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_llama
from tests.runtime._oracle import ADAPTERS, ENGINE_NEW_TOKENS, ROWS, write_adapter


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> dict[str | None, tuple[Path, object]]:
    """Every adapter written by peft, with its PeftModel; the None entry is the base model and its checkpoint."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-oracle")
    out: dict[str | None, tuple[Path, object]] = {
        name: write_adapter(root / name, seed=i + 1, **kwargs) for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    base = make_tiny_llama()
    base.save_pretrained(root / "base")
    out[None] = (root / "base", base)
    return out


@pytest.fixture(scope="session")
def expected(written) -> dict[tuple[tuple[int, ...], str | None], list[int]]:
    """HF generate, greedy, one adapter at a time: the oracle for every (prompt, adapter) the engine tests serve."""
    result = {}
    for prompt, name in ROWS + [([3, 1, 4, 1, 5], name) for name in ADAPTERS]:
        hf = written[name][1]
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=ENGINE_NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        result[(tuple(prompt), name)] = out[0, len(prompt) :].tolist()
    return result
