"""Reading a PEFT LoRA adapter exactly as PEFT does: adapter_config.json and the safetensors key layout.

PEFT's rules, restated for the Llama module names of `BaseModelSpec.module_names()`:
- `target_modules` as a str is a regex `fullmatch`ed against the module name; as a list, an entry matches a module
  whose name equals it or ends with `.entry`, then `layers_to_transform` / `layers_pattern` filter by layer index;
  "all-linear" means every linear but lm_head. `exclude_modules` (str regex or list) wins over targets.
- A module's rank and alpha come from `rank_pattern` / `alpha_pattern`: the first key `k` (in file order) for which
  `re.match(rf"(.*\\.)?({k})$", module_name)` matches, else `r` / `lora_alpha`.
- scaling = alpha / r, or alpha / sqrt(r) with `use_rslora`.
- Weights live at `base_model.model.<module_name>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`; with
  `lora_bias` also `.lora_B.bias` `[out]`, with `use_dora` also `.lora_magnitude_vector` `[out]` (PEFT refuses both
  in one adapter, and so do we).
- `embed_tokens` / `lm_head` targets and `trainable_token_indices`: `peft_vocab` (served with the pool's vocabulary
  columns; plain LoRA only there).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..base_model import PROJECTIONS, BaseModelSpec, ModuleKey
from ..errors import AdapterConfigError, RankTooLargeError, TensorKeyError, UnsupportedAdapterError
from .peft_vocab import (
    TrainableTokens,
    check_token_ids,
    check_vocab_module,
    parse_vocab_key,
    resolve_tokens,
    trainable_token_indices,
)

log = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

_TENSOR_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>[a-z_]+)\."
    r"(?:lora_(?P<ab>[AB])\.weight|(?P<bias>lora_B\.bias)|(?P<magnitude>lora_magnitude_vector))"
)
# Fields that change what the adapter computes; each must be absent or falsy.
_REFUSED_FIELDS = {
    "use_qalora": "QALoRA (use_qalora)",
    "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# Init methods that rewrite the base weights; an adapter still carrying one needs a base model we do not have.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# Fields we read or that do not change inference.
_KNOWN_FIELDS = {
    "peft_type",
    "task_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "bias",
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "lora_dropout",
    "init_lora_weights",
    "auto_mapping",
    "peft_version",
    "megatron_config",
    "megatron_core",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "runtime_config",
    "qalora_group_size",
    "ensure_weight_tying",
    "target_modules_to_tie",
    "trainable_token_indices",
} | set(_REFUSED_FIELDS)


@dataclass(frozen=True)
class ModuleLora:
    """How one targeted module is adapted."""

    rank: int  # r of this module (rank_pattern resolved)
    alpha: float  # lora_alpha of this module (alpha_pattern resolved)
    scaling: float  # alpha / r, or alpha / sqrt(r) with rslora
    tokens: TrainableTokens | None = None  # trainable tokens (a vocabulary module): rank n ids, scaling 1


class Variant(StrEnum):
    """What a LoRA adapter adds per token beyond its two matrices (what metrics and ``/v1/adapters`` name)."""

    LORA = "lora"  # y = W x + s B A x
    DORA = "dora"  # y = g ⊙ (W x + s B A x), g = m / ‖W + s B A‖ per output row (use_dora)
    LORA_BIAS = "lora_bias"  # y = W x + s (B A x + b) (lora_bias)

    @property
    def vector(self) -> str | None:
        """The per-output tensor each targeted module carries ("bias", "magnitude"), None for plain LoRA."""
        return {Variant.DORA: "magnitude", Variant.LORA_BIAS: "bias"}.get(self)

    @property
    def epilogue(self) -> str | None:
        """How the kernels apply its vector row v to a module's output y: "bias" (``y += v``), "scale"
        (``y += y ⊙ v``); None for plain LoRA."""
        return {Variant.DORA: "scale", Variant.LORA_BIAS: "bias"}.get(self)


@dataclass(frozen=True)
class LoraAdapterConfig:
    """The parts of adapter_config.json that decide what the adapter computes."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]  # a regex, or names (with "all-linear" already expanded)
    exclude_modules: str | tuple[str, ...] | None
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model_name_or_path: str | None
    variant: Variant = Variant.LORA
    trainable_tokens: dict[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict
    )  # module -> ids (`peft_vocab`)
    ensure_weight_tying: bool = False

    @classmethod
    def from_file(cls, path: Path, adapter: str) -> LoraAdapterConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise AdapterConfigError(adapter, f"{path.name} is missing") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise AdapterConfigError(adapter, f"{path.name} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise AdapterConfigError(adapter, f"{path.name} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, adapter)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], adapter: str) -> LoraAdapterConfig:
        def fail(message: str) -> AdapterConfigError:
            return AdapterConfigError(adapter, f"{CONFIG_NAME}: {message}")

        if raw.get("peft_type") != "LORA":
            raise fail(f"peft_type must be 'LORA', got {raw.get('peft_type')!r}")
        for field, what in _REFUSED_FIELDS.items():
            if raw.get(field):
                raise UnsupportedAdapterError(adapter, f"{what} is not supported (got {raw[field]!r})")
        init = raw.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
            raise UnsupportedAdapterError(
                adapter, f"init_lora_weights={init!r} rewrites the base weights; convert it to plain LoRA first"
            )
        use_dora, lora_bias = raw.get("use_dora", False), raw.get("lora_bias", False)
        for field, value in (("use_dora", use_dora), ("lora_bias", lora_bias)):
            if not isinstance(value, bool):
                raise fail(f"{field} must be a bool, got {value!r}")
        if use_dora and lora_bias:
            raise UnsupportedAdapterError(adapter, "use_dora and lora_bias together (PEFT refuses them too)")
        if raw.get("bias", "none") not in ("none", "lora_only"):  # lora_only's base biases: refused as tensors
            raise UnsupportedAdapterError(adapter, f"bias must be 'none' or 'lora_only', got {raw['bias']!r}")
        for field, value in raw.items():
            if field in _KNOWN_FIELDS:
                continue
            if value and (field.startswith("use_") or field.endswith("_config")):
                raise UnsupportedAdapterError(adapter, f"unknown LoRA variant field {field}={value!r}")
            log.warning("adapter %r: ignoring unknown %s field %r", adapter, CONFIG_NAME, field)
        if raw.get("fan_in_fan_out"):
            log.warning("adapter %r: fan_in_fan_out=True on nn.Linear targets; PEFT ignores it, so do we", adapter)

        r = raw.get("r")
        if not _is_int(r) or r <= 0:
            raise fail(f"r must be a positive int, got {r!r}")
        alpha = raw.get("lora_alpha", 8)
        if not _is_number(alpha):
            raise fail(f"lora_alpha must be a number, got {alpha!r}")
        rank_pattern = raw.get("rank_pattern") or {}
        alpha_pattern = raw.get("alpha_pattern") or {}
        if not isinstance(rank_pattern, dict) or not all(_is_int(v) and v > 0 for v in rank_pattern.values()):
            raise fail(f"rank_pattern must map names to positive ints, got {rank_pattern!r}")
        if not isinstance(alpha_pattern, dict) or not all(_is_number(v) for v in alpha_pattern.values()):
            raise fail(f"alpha_pattern must map names to numbers, got {alpha_pattern!r}")
        use_rslora = raw.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise fail(f"use_rslora must be a bool, got {use_rslora!r}")
        base = raw.get("base_model_name_or_path")
        if base is not None and not isinstance(base, str):
            raise fail(f"base_model_name_or_path must be a string, got {base!r}")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            use_rslora=use_rslora,
            target_modules=_targets(raw.get("target_modules"), fail),
            exclude_modules=_names_or_regex(raw.get("exclude_modules"), "exclude_modules", fail),
            layers_to_transform=_layers(raw.get("layers_to_transform"), fail),
            layers_pattern=_layers_pattern(raw.get("layers_pattern"), fail),
            rank_pattern=dict(rank_pattern),
            alpha_pattern={k: float(v) for k, v in alpha_pattern.items()},
            base_model_name_or_path=base,
            variant=Variant.DORA if use_dora else Variant.LORA_BIAS if lora_bias else Variant.LORA,
            trainable_tokens=trainable_token_indices(raw.get("trainable_token_indices"), adapter, fail),
            ensure_weight_tying=bool(raw.get("ensure_weight_tying", False)),
        )

    def targets(self, name: str) -> bool:
        """Whether PEFT would wrap the module called `name`."""
        if self.exclude_modules is not None and _matches(self.exclude_modules, name):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        if name in self.target_modules:
            return True
        if not any(name.endswith(f".{t}") for t in self.target_modules):
            return False
        layers = self.layers_to_transform
        if layers is None or layers == ():
            return True
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            match = next(
                (m for p in self.layers_pattern if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name))), None
            )
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == layers if isinstance(layers, int) else index in layers

    def module_lora(self, name: str) -> ModuleLora:
        """Rank, alpha and scaling of a targeted module, resolved as PEFT resolves them."""
        rank = self.rank_pattern.get(_pattern_key(self.rank_pattern, name), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, name), self.lora_alpha)
        scaling = alpha / math.sqrt(rank) if self.use_rslora else alpha / rank
        return ModuleLora(rank=rank, alpha=alpha, scaling=scaling)

    def resolve(self, spec: BaseModelSpec, adapter: str, max_rank: int) -> dict[ModuleKey, ModuleLora]:
        """Every module of the base model this adapter targets, refusing targets we cannot serve."""
        by_name = {key.module_name: key for key in spec.module_keys() + spec.vocab_keys()}
        modules: dict[ModuleKey, ModuleLora] = {}
        for name in spec.module_names():
            if not self.targets(name):
                continue
            keys = spec.fused_parts(name) or ((by_name[name],) if name in by_name else ())  # a fused one: its parts
            if not keys:
                raise UnsupportedAdapterError(
                    adapter, f"target {name!r} is a non-linear module; only {PROJECTIONS}, embed_tokens and lm_head "
                    "are supported"
                )  # fmt: skip
            lora = self.module_lora(name)
            if keys[0].is_vocab:
                check_vocab_module(name, lora.rank, spec, adapter, max_rank, "LoRA")
                if self.variant is not Variant.LORA:
                    raise UnsupportedAdapterError(adapter, f"{self.variant.value} on {name} is not supported")
            if lora.rank > max_rank:
                raise RankTooLargeError(adapter, f"module {name!r} has rank {lora.rank} > max_rank {max_rank}")
            modules.update(dict.fromkeys(keys, lora))
        tokens = resolve_tokens(self.trainable_tokens, self.ensure_weight_tying, spec, adapter)
        for name, trained in tokens.items():
            key = ModuleKey.vocab(name)
            if key in modules:
                raise UnsupportedAdapterError(adapter, f"{name} has both LoRA and trainable tokens")
            check_vocab_module(name, len(trained.ids), spec, adapter, max_rank, f"{len(trained.ids)} trainable tokens")
            check_token_ids(name, trained.ids, spec, adapter)
            modules[key] = ModuleLora(rank=len(trained.ids), alpha=1.0, scaling=1.0, tokens=trained)
        if not modules:
            raise UnsupportedAdapterError(
                adapter, f"target_modules {self.target_modules!r} match no module of the base model"
            )
        return modules


def parse_tensor_key(key: str, adapter: str) -> tuple[ModuleKey, str]:
    """`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` -> (ModuleKey(3, "q_proj"), "A"); the kind
    is "A", "B", "bias" (`.lora_B.bias`) or "magnitude" (`.lora_magnitude_vector`); of a vocabulary module also
    "base" and "tokens" (`peft_vocab.parse_vocab_key`)."""
    vocab = parse_vocab_key(key)
    if vocab is not None:
        if vocab[1] == "other":
            raise UnsupportedAdapterError(adapter, f"tensor {key!r}: not a LoRA or trainable-tokens tensor")
        return vocab
    match = _TENSOR_KEY.fullmatch(key)
    if match is None and key.endswith(".bias"):
        raise TensorKeyError(
            adapter, f"tensor {key!r} is a trained base-layer bias (adapter_config.json bias 'all' / 'lora_only'); "
            "only LoRA weights are served"
        )  # fmt: skip
    if match is None or match["proj"] not in PROJECTIONS:
        raise TensorKeyError(adapter, f"unexpected tensor key {key!r} in {WEIGHTS_NAME}")
    module = ModuleKey(int(match["layer"]), match["proj"])
    if module.module_name not in key:
        raise TensorKeyError(adapter, f"tensor {key!r}: {module.proj} does not belong under that submodule")
    return module, match["ab"] or ("bias" if match["bias"] else "magnitude")


def _pattern_key(patterns: dict[str, Any], name: str) -> str:
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", name)), name)


def _matches(targets: str | tuple[str, ...], name: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith(f".{t}") for t in targets)


def _targets(value: Any, fail) -> str | tuple[str, ...]:
    if isinstance(value, str) and value.lower() == "all-linear":
        return PROJECTIONS
    targets = _names_or_regex(value, "target_modules", fail)
    if targets is None:
        raise fail("target_modules is missing")
    return targets


def _names_or_regex(value: Any, field: str, fail) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as err:
            raise fail(f"{field} is not a valid regex ({err}): {value!r}") from None
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise fail(f"{field} must be a string or a list of strings, got {value!r}")


def _layers(value: Any, fail) -> int | tuple[int, ...] | None:
    if value is None or _is_int(value):
        return value
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return tuple(value)
    raise fail(f"layers_to_transform must be an int or a list of ints, got {value!r}")


def _layers_pattern(value: Any, fail) -> tuple[str, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise fail(f"layers_pattern must be a string or a list of strings, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
