"""A corpus of malformed adapters: each case mutates a valid one and names the exact error registering it raises."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adapter_manager import (
    AdapterConfigError,
    BaseModelMismatchError,
    CorruptWeightsError,
    NonFiniteWeightsError,
    PickleRefusedError,
    RankTooLargeError,
    RowOptions,
    TensorKeyError,
    TensorShapeError,
    UnsupportedAdapterError,
)
from adapter_manager.sources.peft_format import CONFIG_NAME, WEIGHTS_NAME

KEY = "base_model.model.model.layers.{layer}.{parent}.{proj}.lora_{ab}.weight"
EMBED = "base_model.model.model.embed_tokens."
TOKENS = "token_adapter.trainable_tokens_delta"
VOCAB = {"rows": RowOptions(max_rank=8, lora_vocab=True)}  # RegistryConfig with the vocabulary columns


def key(layer: int, proj: str, ab: str) -> str:
    parent = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return KEY.format(layer=layer, parent=parent, proj=proj, ab=ab)


def edit_config(**changes) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        path = folder / CONFIG_NAME
        raw = json.loads(path.read_text())
        raw.update(changes)
        path.write_text(json.dumps(raw))

    return mutate


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        tensors = load_file(folder / WEIGHTS_NAME)
        change(tensors)
        save_file(tensors, folder / WEIGHTS_NAME)

    return mutate


def both(*mutations: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(folder: Path) -> None:
        for m in mutations:
            m(folder)

    return mutate


def write_text(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def truncate_weights(folder: Path) -> None:
    data = (folder / WEIGHTS_NAME).read_bytes()
    (folder / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])


def pickle_only(folder: Path) -> None:
    (folder / WEIGHTS_NAME).rename(folder / "adapter_model.bin")


def add_tensor(name: str, tensor: torch.Tensor) -> Callable[[Path], None]:
    return edit_tensors(lambda t: t.__setitem__(name, tensor))


def drop_tensor(name: str) -> Callable[[Path], None]:
    return edit_tensors(lambda t: t.pop(name))


def add_vectors(kind: str, width_of: Callable[[str], int]) -> Callable[[Path], None]:
    """A variant's vector beside every lora_A: ``kind`` "lora_B.bias" or "lora_magnitude_vector", ``width_of(proj)``
    wide (the right width is the module's out features)."""

    def change(tensors):
        for name in [n for n in tensors if n.endswith(".lora_A.weight")]:
            proj = name.split(".")[-3]
            tensors[name.replace("lora_A.weight", kind)] = torch.full((width_of(proj),), 0.5)

    return edit_tensors(change)


def poison(name: str, value: float) -> Callable[[Path], None]:
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] = value

    return edit_tensors(change)


@dataclass(frozen=True)
class Case:
    name: str
    mutate: Callable[[Path], None]
    error: type[Exception]
    registry: dict = field(default_factory=dict)  # RegistryConfig overrides


# The valid adapter every case starts from: tiny Llama (H=32, I=48, 3 layers, kv width 16), r=4, q_proj + v_proj.
CASES = [
    Case("config_not_json", write_text(CONFIG_NAME, "{not json"), AdapterConfigError),
    Case("config_is_a_list", write_text(CONFIG_NAME, "[1, 2]"), AdapterConfigError),
    Case("config_missing", lambda f: (f / CONFIG_NAME).unlink(), AdapterConfigError),
    Case("peft_type_ia3", edit_config(peft_type="IA3"), AdapterConfigError),
    Case("rank_zero", edit_config(r=0), AdapterConfigError),
    Case("rank_is_string", edit_config(r="4"), AdapterConfigError),
    Case(
        "alpha_nan",
        write_text(CONFIG_NAME, '{"peft_type": "LORA", "r": 4, "lora_alpha": NaN, "target_modules": ["q_proj"]}'),
        AdapterConfigError,
    ),
    Case("target_regex_invalid", edit_config(target_modules="(q_proj"), AdapterConfigError),
    Case("use_dora_without_magnitudes", edit_config(use_dora=True), TensorKeyError),
    Case("use_dora_not_a_bool", edit_config(use_dora="yes"), AdapterConfigError),
    Case("dora_and_lora_bias", edit_config(use_dora=True, lora_bias=True), UnsupportedAdapterError),
    Case("modules_to_save", edit_config(modules_to_save=["lm_head"]), UnsupportedAdapterError),
    Case("lora_bias_without_biases", edit_config(lora_bias=True), TensorKeyError),
    Case(
        "lora_bias_wrong_width",
        both(edit_config(lora_bias=True), add_vectors("lora_B.bias", lambda proj: 32 if proj == "q_proj" else 17)),
        TensorShapeError,
    ),
    Case(
        "lora_bias_inf",
        both(
            edit_config(lora_bias=True),
            add_vectors("lora_B.bias", lambda proj: {"q_proj": 32}.get(proj, 16)),
            poison(
                KEY.format(layer=1, parent="self_attn", proj="v_proj", ab="B").replace(".weight", ".bias"), float("inf")
            ),
        ),
        NonFiniteWeightsError,
    ),  # fmt: skip
    Case(
        "magnitudes_without_use_dora",
        add_vectors("lora_magnitude_vector", lambda proj: {"q_proj": 32}.get(proj, 16)),
        TensorKeyError,
    ),
    Case("bias_all", edit_config(bias="all"), UnsupportedAdapterError),
    Case(
        "bias_lora_only_with_base_biases",
        both(
            edit_config(bias="lora_only"),
            add_tensor("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", torch.zeros(32)),
        ),
        TensorKeyError,
    ),
    Case("pissa_init", edit_config(init_lora_weights="pissa"), UnsupportedAdapterError),
    Case("unknown_variant", edit_config(use_fancy_lora=True), UnsupportedAdapterError),
    Case(
        "target_embed_tokens", edit_config(target_modules=["q_proj", "v_proj", "embed_tokens"]), UnsupportedAdapterError
    ),
    Case("target_lm_head", edit_config(target_modules=["lm_head"]), UnsupportedAdapterError),
    Case("target_matches_nothing", edit_config(target_modules=["c_attn"]), UnsupportedAdapterError),
    Case("target_non_linear", edit_config(target_modules=["self_attn"]), UnsupportedAdapterError),
    Case("rank_above_max", edit_config(r=4), RankTooLargeError, {"rows": RowOptions(max_rank=2)}),
    Case(
        "rank_pattern_above_max",
        edit_config(rank_pattern={"v_proj": 16}),
        RankTooLargeError,
        {"rows": RowOptions(max_rank=8)},
    ),
    Case("unknown_tensor_key", add_tensor("base_model.model.foo.weight", torch.zeros(2)), TensorKeyError),
    Case("tensor_for_untargeted_module", add_tensor(key(0, "k_proj", "A"), torch.zeros(4, 32)), TensorKeyError),
    Case("tensor_for_missing_layer", add_tensor(key(7, "q_proj", "A"), torch.zeros(4, 32)), TensorKeyError),
    Case(
        "proj_under_wrong_parent",
        add_tensor(KEY.format(layer=0, parent="mlp", proj="q_proj", ab="A"), torch.zeros(4, 32)),
        TensorKeyError,
    ),
    Case("missing_lora_B", drop_tensor(key(1, "v_proj", "B")), TensorKeyError),
    Case("missing_lora_A", drop_tensor(key(2, "q_proj", "A")), TensorKeyError),
    Case(
        "dora_magnitude_key",
        add_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(32)),
        TensorKeyError,
    ),
    Case(
        "embedding_lora_key",
        add_tensor("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, 64)),
        TensorKeyError,
    ),
    Case("tokens_vocab_off", edit_config(trainable_token_indices=[3]), UnsupportedAdapterError),
    Case(
        "embed_wrong_vocab",
        both(
            edit_config(target_modules=["q_proj", "v_proj", "embed_tokens"]),
            add_tensor(EMBED + "lora_embedding_A", torch.zeros(4, 63)),
            add_tensor(EMBED + "lora_embedding_B", torch.zeros(32, 4)),
        ),
        TensorShapeError,
        VOCAB,
    ),
    Case(
        "embed_missing_B",
        both(
            edit_config(target_modules=["q_proj", "v_proj", "embed_tokens"]),
            add_tensor(EMBED + "lora_embedding_A", torch.zeros(4, 64)),
        ),
        TensorKeyError,
        VOCAB,
    ),
    Case("lm_head_dora", edit_config(use_dora=True, target_modules=["lm_head"]), UnsupportedAdapterError, VOCAB),
    Case("tokens_out_of_vocab", edit_config(trainable_token_indices=[3, 64]), AdapterConfigError, VOCAB),
    Case("tokens_repeated", edit_config(trainable_token_indices=[3, 3]), AdapterConfigError, VOCAB),
    Case("tokens_not_ints", edit_config(trainable_token_indices=["3"]), AdapterConfigError, VOCAB),
    Case("tokens_on_q_proj", edit_config(trainable_token_indices={"q_proj": [1]}), UnsupportedAdapterError, VOCAB),
    Case("tokens_missing_rows", edit_config(trainable_token_indices=[3, 5]), TensorKeyError, VOCAB),
    Case(
        "tokens_wrong_width",
        both(edit_config(trainable_token_indices=[3, 5]), add_tensor(EMBED + TOKENS, torch.zeros(2, 31))),
        TensorShapeError,
        VOCAB,
    ),
    Case(
        "tokens_nan",
        both(edit_config(trainable_token_indices=[3, 5]), add_tensor(EMBED + TOKENS, torch.full((2, 32), math.nan))),
        NonFiniteWeightsError,
        VOCAB,
    ),
    Case(
        "tokens_above_max_rank",
        edit_config(r=2, trainable_token_indices=list(range(9))),
        RankTooLargeError,
        VOCAB,  # max_rank 8
    ),
    Case(
        "tokens_and_lora_on_embed_tokens",
        edit_config(target_modules=["q_proj", "v_proj", "embed_tokens"], trainable_token_indices=[3]),
        UnsupportedAdapterError,
        VOCAB,
    ),
    Case(
        "lora_B_bias_key",
        add_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", torch.zeros(32)),
        TensorKeyError,
    ),
    Case("A_wrong_in_features", add_tensor(key(0, "q_proj", "A"), torch.zeros(4, 31)), TensorShapeError),
    Case("B_wrong_rank", add_tensor(key(0, "v_proj", "B"), torch.zeros(16, 5)), TensorShapeError),
    Case("v_proj_without_gqa_width", add_tensor(key(1, "v_proj", "B"), torch.zeros(32, 4)), TensorShapeError),
    Case("A_transposed", add_tensor(key(0, "q_proj", "A"), torch.zeros(32, 4)), TensorShapeError),
    Case("integer_tensor", add_tensor(key(0, "q_proj", "A"), torch.zeros(4, 32, dtype=torch.int32)), TensorShapeError),
    Case("nan_in_A", poison(key(1, "q_proj", "A"), float("nan")), NonFiniteWeightsError),
    Case("inf_in_B", poison(key(2, "v_proj", "B"), float("inf")), NonFiniteWeightsError),
    Case("overflow_in_fp16", poison(key(0, "v_proj", "B"), 1e30), NonFiniteWeightsError, {"dtype": torch.float16}),
    Case("weights_truncated", truncate_weights, CorruptWeightsError),
    Case("weights_garbage", write_text(WEIGHTS_NAME, "this is not a safetensors file"), CorruptWeightsError),
    Case("weights_missing", lambda f: (f / WEIGHTS_NAME).unlink(), CorruptWeightsError),
    Case("pickle_only", pickle_only, PickleRefusedError),
    Case(
        "base_model_mismatch_refused",
        edit_config(base_model_name_or_path="other-org/mistral-7b"),
        BaseModelMismatchError,
        {"base_model_mismatch": "refuse"},
    ),
]
