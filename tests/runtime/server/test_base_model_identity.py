"""An adapter's base model is checked against the served checkpoint's identity (its folder, the hub id or path it was
served from), not only the name it is served under (``--model-name``)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from adapter_manager import AdapterManagerConfig, BaseModelMismatchError, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.launch import build_serving, checkpoint_aliases
from adapter_manager.runtime.server.state import ServerConfig


@pytest.fixture(scope="module")
def peft_adapter(checkpoint_root: Path) -> Path:
    """A real PEFT adapter of the served tiny checkpoint."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.LlamaForCausalLM.from_pretrained(checkpoint_root / "model")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    folder = checkpoint_root / "identity-adapter"
    peft.get_peft_model(base, config).save_pretrained(folder)
    return folder


def _trained_on(adapter: Path, tmp_path: Path, base: str) -> Path:
    """A copy of ``adapter`` whose config's base_model_name_or_path is ``base``."""
    folder = tmp_path / f"adapter-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
    return folder


def _serve(model: Path, mismatch: str, model_ref: str | None = None):
    return build_serving(
        model,
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=16), base_model_mismatch=mismatch),
        EngineConfig(max_batch=2, max_seq_len=32),
        ServerConfig(model_name="alias", port=0),
        model_ref=model_ref,
    )


@pytest.mark.parametrize("mismatch", ["warn", "refuse"])
def test_an_adapter_trained_on_the_served_folder_registers_under_an_alias(
    checkpoint_root: Path, peft_adapter: Path, tmp_path: Path, caplog, mismatch: str
) -> None:
    model = checkpoint_root / "model"
    adapter = _trained_on(peft_adapter, tmp_path, str(model))
    serving = _serve(model, mismatch)
    try:
        with caplog.at_level(logging.WARNING):
            result = serving.manager.register(str(adapter), "on-folder")
        assert not result.record.warnings
        assert "trained on base model" not in caplog.text
    finally:
        serving.close()


def test_the_hub_id_served_counts_and_a_stranger_is_named_with_what_was_compared(
    checkpoint_root: Path, peft_adapter: Path, tmp_path: Path
) -> None:
    model = checkpoint_root / "model"
    serving = _serve(model, "refuse", model_ref="org/tiny-llama@v2")
    try:
        serving.manager.register(str(_trained_on(peft_adapter, tmp_path, "org/tiny-llama")), "by-hub-id")
        with pytest.raises(BaseModelMismatchError) as err:
            serving.manager.register(str(_trained_on(peft_adapter, tmp_path, "other/stranger-llama")), "stranger")
        message = str(err.value)
        assert "'other/stranger-llama'" in message and "'alias'" in message and "'org/tiny-llama@v2'" in message
        assert str(model.resolve()) in message
    finally:
        serving.close()


def test_checkpoint_aliases(tmp_path: Path) -> None:
    assert checkpoint_aliases(tmp_path, "org/m@v1") == (str(tmp_path.resolve()), "org/m@v1", "org/m")
    assert checkpoint_aliases(tmp_path) == (str(tmp_path.resolve()),)
