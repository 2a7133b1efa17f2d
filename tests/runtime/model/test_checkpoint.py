"""HF checkpoints both ways: our random writer loads in transformers; transformers' save_pretrained loads in ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adapter_manager.runtime.model.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    CheckpointSource,
    load_checkpoint,
    load_model,
    resolve_dtype,
    write_random_checkpoint,
)
from adapter_manager.runtime.model.config import LlamaConfig, RopeScaling
from adapter_manager.runtime.model.cpu_features import warn_if_slow_bf16
from tests.conftest import TINY, make_tiny_llama
from tests.runtime._steps import prefill_logits

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
SMALL = LlamaConfig(hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)


def assert_same_logits(ours_folder: Path, hf, tol: float = 1e-4) -> None:
    model = load_model(ours_folder)
    model.setup_caches(max_batch=len(PROMPTS), max_seq_len=16)
    for logits, prompt in zip(prefill_logits(model, PROMPTS), PROMPTS, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (logits - ref).abs().max().item() <= tol


@pytest.mark.parametrize(
    "config",
    [
        SMALL,
        LlamaConfig(**{**SMALL.__dict__, "tie_word_embeddings": True}),
        LlamaConfig(**{**SMALL.__dict__, "rope_scaling": RopeScaling("llama3", original_max_position_embeddings=4)}),
        LlamaConfig(**{**SMALL.__dict__, "head_dim": 16}),
    ],
    ids=["untied", "tied", "llama3", "wide_heads"],
)
@pytest.mark.parametrize("max_shard_bytes", [None, 8_000], ids=["single", "sharded"])
def test_our_writer_loads_in_transformers(tmp_path: Path, config: LlamaConfig, max_shard_bytes: int | None) -> None:
    folder = write_random_checkpoint(config, tmp_path, seed=3, max_shard_bytes=max_shard_bytes, std=0.2)
    assert (folder / (INDEX_FILE if max_shard_bytes else SINGLE_FILE)).is_file()
    if max_shard_bytes:
        assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    assert LlamaConfig.from_hf(folder) == config
    assert_same_logits(folder, hf)


def test_writer_is_deterministic(tmp_path: Path) -> None:
    a = write_random_checkpoint(SMALL, tmp_path / "a", seed=5)
    b = write_random_checkpoint(SMALL, tmp_path / "b", seed=5)
    c = write_random_checkpoint(SMALL, tmp_path / "c", seed=6)
    assert (a / SINGLE_FILE).read_bytes() == (b / SINGLE_FILE).read_bytes() != (c / SINGLE_FILE).read_bytes()


@pytest.mark.parametrize("max_shard_size", [None, "20KB"], ids=["single", "sharded"])
def test_transformers_save_pretrained_loads_in_ours(tmp_path: Path, max_shard_size: str | None) -> None:
    hf = make_tiny_llama()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / INDEX_FILE).is_file() == bool(max_shard_size)
    assert_same_logits(tmp_path, hf)


def test_load_casts_to_the_serving_dtype_and_allocates_once(tmp_path: Path) -> None:
    write_random_checkpoint(SMALL, tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16, pack_weights=False)
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16} and {p.device.type for p in params} == {"cpu"}
    assert not any(p.requires_grad for p in params)
    hidden, kv = SMALL.hidden_size, SMALL.num_kv_heads * SMALL.head_dim
    assert tuple(model.layers[0].attention.wqkv.weight.shape) == (hidden + 2 * kv, hidden)


def test_refuses_pickle_missing_and_misshapen(tmp_path: Path) -> None:
    folder = write_random_checkpoint(SMALL, tmp_path / "ok")
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text((folder / "config.json").read_text())
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_model(tmp_path / "pickle")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)
    tensors = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    save_file(tensors, folder / SINGLE_FILE)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight.*\[3, 3\], expected \[64, 32\]"):
        load_model(folder)
    save_file({"model.norm.weight": torch.ones(32)}, folder / SINGLE_FILE)
    with pytest.raises(CheckpointError, match="missing"):
        load_model(folder)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        CheckpointSource(str(tmp_path / "absent")).resolve()


def test_hub_id_through_local_hub_then_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from adapter_manager.sources.local_hub import LocalHub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    repo = write_random_checkpoint(SMALL, tmp_path / "hub" / "org" / "tiny", seed=9)
    (repo / "pytorch_model.bin").write_bytes(b"never downloaded")
    cache = tmp_path / "cache"
    with LocalHub(tmp_path / "hub") as hub:
        source = CheckpointSource("org/tiny", cache_dir=cache, endpoint=hub.endpoint, token=False)
        model, folder = load_checkpoint(source)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", SINGLE_FILE]
    offline, again = load_checkpoint(CheckpointSource("org/tiny", cache_dir=cache, offline=True, token=False))
    assert again == folder
    for a, b in zip(model.parameters(), offline.parameters(), strict=True):
        assert torch.equal(a, b)
    local, _ = load_checkpoint(str(repo))
    assert torch.equal(local.tok_embeddings.weight, model.tok_embeddings.weight)


def test_config_reads_both_rope_layouts(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": 2, "max_position_embeddings": 2048},  # 2048: transformers' default
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    legacy = {**saved, "rope_theta": 5e5, "rope_scaling": saved.get("rope_parameters") or saved["rope_scaling"]}
    legacy.pop("rope_parameters", None)
    for source in (tmp_path, legacy):
        ours = LlamaConfig.from_hf(source)
        assert ours.rope_theta == 5e5
        assert ours.rope_scaling == RopeScaling("llama3", 4.0, 1.0, 4.0, 32)
        assert ours.head_dim == 8 and ours.num_kv_heads == 2


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, torch.bfloat16),  # transformers before 4.56
        ({"dtype": "float16"}, torch.float16),  # transformers >= 4.56
        ({"dtype": "torch.bfloat16"}, torch.bfloat16),
        ({}, torch.float32),  # names none
        ({"torch_dtype": None}, torch.float32),
        ({"torch_dtype": "float64"}, torch.float32),  # not a serving dtype
    ],
)
def test_dtype_auto_is_the_checkpoints_own(tmp_path: Path, config: dict, expected: torch.dtype, caplog) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("INFO", logger="adapter_manager.runtime.model.checkpoint"):
        assert resolve_dtype(tmp_path) == expected == resolve_dtype(config, "auto")
    assert f"dtype auto: serving in {str(expected).removeprefix('torch.')}" in caplog.text
    assert resolve_dtype(tmp_path, "float32") == torch.float32 == resolve_dtype(None, torch.float32)


def test_dtype_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        resolve_dtype({}, "float8")
    with pytest.raises(ValueError, match="name its folder"):
        resolve_dtype(None)
    with pytest.raises(CheckpointError, match="cannot read"):
        resolve_dtype(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        resolve_dtype(tmp_path)


def test_load_model_serves_a_bf16_checkpoint_in_bf16_by_default(tmp_path: Path) -> None:
    write_random_checkpoint(SMALL, tmp_path / "bf16", dtype=torch.bfloat16)
    write_random_checkpoint(SMALL, tmp_path / "fp32")
    assert load_model(tmp_path / "bf16", pack_weights=False).dtype == torch.bfloat16
    assert load_model(tmp_path / "bf16", dtype="float32", pack_weights=False).dtype == torch.float32
    assert load_model(tmp_path / "fp32", pack_weights=False).dtype == torch.float32


def test_bf16_warns_once_where_the_cpu_emulates_it(caplog) -> None:
    import adapter_manager.runtime.model.cpu_features as features

    features._warned = False
    with caplog.at_level("WARNING", logger=features.__name__):
        assert not warn_if_slow_bf16(torch.float32, {"avx2"})
        assert not warn_if_slow_bf16(torch.bfloat16, {"avx2", "avx512_bf16"})
        assert not warn_if_slow_bf16(torch.bfloat16, {"amx_bf16"})
        assert warn_if_slow_bf16(torch.bfloat16, {"avx2", "fma"})
        assert not warn_if_slow_bf16(torch.bfloat16, {"avx2"})  # once per process
    assert caplog.text.count("--dtype float32") == 1
    features._warned = False
