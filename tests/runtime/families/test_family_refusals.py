"""Every checkpoint the engine does not compute exactly is refused at load by one typed error naming the architecture
and the field, never served: other families, foreign terms on a served family's config, an activation, a rope type,
a sliding window shorter than the context; and the CLI answers it with exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from adapter_manager.runtime.model.families import UnsupportedModelError
from tests.runtime.families._models import SHAPE, hf_model

transformers = pytest.importorskip("transformers")

# (transformers config class, causal LM class, config fields, the architecture and field the refusal names)
REFUSED = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}, "granite", "model_type"),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}, "helium", "model_type"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, "smollm3", "model_type"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}, "ernie4_5", "model_type"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "olmo2", "model_type"),
    "gemma3-linear-rope": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }},
        "gemma3_text",
        "rope_parameters.rope_type",
    ),
    "llama-gelu": ("LlamaConfig", "LlamaForCausalLM", {"hidden_act": "gelu"}, "llama", "hidden_act"),
    "llama-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
        "llama",
        "rope_parameters.rope_type",
    ),
}


def _write(folder, config_class, model_class, fields):
    config = getattr(transformers, config_class)(**SHAPE, vocab_size=512, **fields)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    getattr(transformers, model_class)(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_checkpoint_we_do_not_compute_is_refused_by_name(case, tmp_path) -> None:
    config_class, model_class, fields, architecture, field = REFUSED[case]
    folder = _write(tmp_path / case, config_class, model_class, fields)
    with pytest.raises(UnsupportedModelError) as refused:
        load_model(folder, dtype=torch.float32)
    assert (refused.value.architecture, refused.value.field) == (architecture, field)
    assert architecture in str(refused.value) and field in str(refused.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("embedding_multiplier", 12.0), ("no_rope_layers", [1, 0]), ("partial_rotary_factor", 0.5)],
)
def test_foreign_terms_on_a_llama_config_are_refused(field, value) -> None:
    config = {**LlamaConfig.tiny().to_hf(), field: value}
    with pytest.raises(UnsupportedModelError, match=field):
        LlamaConfig.from_hf(config)


def test_an_architecture_other_than_the_familys_causal_lm_is_refused() -> None:
    config = {**LlamaConfig.tiny().to_hf(), "architectures": ["LlamaForSequenceClassification"]}
    with pytest.raises(UnsupportedModelError) as refused:
        LlamaConfig.from_hf(config)
    assert refused.value.field == "architectures"


def test_llama_attention_and_mlp_bias_are_served() -> None:
    config = LlamaConfig.from_hf({**LlamaConfig.tiny().to_hf(), "attention_bias": True, "mlp_bias": True})
    assert config.bias == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_mistral_past_its_window_is_refused_and_served_within_it(tmp_path) -> None:
    hf_model("mistral", sliding_window=32).save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    model.setup_caches(max_batch=2, max_seq_len=32)  # every context fits the window: exact
    with pytest.raises(UnsupportedModelError) as refused:
        model.setup_caches(max_batch=2, max_seq_len=33)
    assert (refused.value.architecture, refused.value.field) == ("mistral", "sliding_window")
    assert "max_seq_len <= 32" in str(refused.value)


def test_qwen2_sliding_window_off_is_no_window() -> None:
    config = transformers.Qwen2Config(**SHAPE, vocab_size=512, sliding_window=8, use_sliding_window=False)
    assert LlamaConfig.from_hf(config.to_diff_dict()).sliding_window is None


def test_serve_answers_an_unsupported_checkpoint_with_exit_2(tmp_path) -> None:
    folder = _write(tmp_path / "granite", "GraniteConfig", "GraniteForCausalLM", {})
    done = subprocess.run(
        [sys.executable, "-m", "adapter_manager.runtime.cli", "serve", str(folder), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "granite: model_type" in done.stderr
