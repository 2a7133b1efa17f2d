"""PEFT's vocabulary modules, restated: embedding and lm_head LoRA, and trainable tokens (PEFT >= 0.15).

- **Embedding LoRA** (``embed_tokens`` in ``target_modules``): ``lora_embedding_A [r, V]`` and ``lora_embedding_B
  [H, r]`` at ``base_model.model.model.embed_tokens.``; a token t adds ``s · B · A[:, t]`` to its embedding. PEFT also
  saves the frozen table it wrapped (``embed_tokens.base_layer.weight``).
- **lm_head LoRA** (``lm_head`` in ``target_modules``): an ordinary linear LoRA, ``A [r, H]``, ``B [V, r]``, with the
  head's frozen weight saved beside it (``lm_head.base_layer.weight``); with tied embeddings the base is the table.
- **Trainable tokens** (``trainable_token_indices``: a list of ids for the input embedding, or ``{module: ids}``):
  the module's rows for those ids are *replaced* by ``token_adapter.trainable_tokens_delta [n, H]`` (PEFT's
  ``index_copy``; the name says delta, the values are the new rows). With tied embeddings PEFT ties the head to the
  embedding's adapter (same ids, same rows, no tensor of its own) unless the two are given different ids.

Both serve as LoRA over the pool's vocabulary columns (`tiers.row_layout`): trainable tokens are a LoRA of rank n
with one-hot factors, ``E' = E + onehot(ids)ᵀ (R - E[ids])`` for the embedding, ``W' = W + onehot(ids)ᵀ (R - W[ids])``
for the head, so one kernel serves the three (see `tiers.vocab`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..base_model import BaseModelSpec, ModuleKey
from ..errors import AdapterConfigError, RankTooLargeError, UnsupportedAdapterError

_VOCAB_KEY = re.compile(
    r"base_model\.model\.(?:model\.(?P<embed>embed_tokens)|(?P<head>lm_head))\."
    r"(?:(?P<emb_ab>lora_embedding_[AB])|lora_(?P<ab>[AB])\.weight|(?P<base>base_layer\.weight)"
    r"|(?P<tokens>token_adapter\.trainable_tokens_delta)|(?P<other>.+))"
)


@dataclass(frozen=True)
class TrainableTokens:
    """One vocabulary module's trainable tokens: ``ids`` replaced by the rows of the tensor PEFT saved for
    ``source`` (the module itself, or the embedding for a head tied to it)."""

    ids: tuple[int, ...]
    source: str  # "embed_tokens" or "lm_head": whose `token_adapter.trainable_tokens_delta` holds the rows


def parse_vocab_key(key: str) -> tuple[ModuleKey, str] | None:
    """``...embed_tokens.lora_embedding_A`` -> (ModuleKey.vocab("embed_tokens"), "A"); kinds "A", "B", "base" (the
    wrapped module's saved weight), "tokens" (trainable tokens' rows) and "other" (anything else under it); None
    for a key outside the vocabulary modules."""
    match = _VOCAB_KEY.fullmatch(key)
    if match is None:
        return None
    module = ModuleKey.vocab(match["embed"] or match["head"])
    if match["emb_ab"]:
        if module.proj != "embed_tokens":
            return module, "other"
        return module, match["emb_ab"][-1]
    if match["ab"]:
        return module, match["ab"] if module.proj == "lm_head" else "other"
    return module, "base" if match["base"] else "tokens" if match["tokens"] else "other"


def trainable_token_indices(value: Any, adapter: str, fail) -> dict[str, tuple[int, ...]]:
    """The config's ``trainable_token_indices`` as {"embed_tokens" | "lm_head": ids} (a list names the embedding;
    PEFT matches a dict's names by suffix)."""
    if value is None:
        return {}
    if isinstance(value, list):
        value = {"embed_tokens": value}
    if not isinstance(value, dict) or not value:
        raise fail(f"trainable_token_indices must be a list of ints or a dict of them, got {value!r}")
    found: dict[str, tuple[int, ...]] = {}
    for name, ids in value.items():
        module = next((m for m in ("embed_tokens", "lm_head") if isinstance(name, str) and name.endswith(m)), None)
        if module is None:
            raise UnsupportedAdapterError(adapter, f"trainable tokens on {name!r}: only embed_tokens and lm_head")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise fail(f"trainable_token_indices[{name!r}] must be a non-empty list of ints, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise fail(f"trainable_token_indices[{name!r}] repeats a token id: {ids!r}")
        found[module] = tuple(ids)
    return found


def resolve_tokens(
    tokens: dict[str, tuple[int, ...]], ensure_tying: bool, spec: BaseModelSpec, adapter: str
) -> dict[str, TrainableTokens]:
    """Which vocabulary module replaces which rows, after PEFT's weight tying (`peft.utils.other`): with tied
    embeddings and the embedding's tokens trained, the head takes the embedding's ids and rows, unless both are
    given and their ids differ (then each its own; PEFT refuses that with ``ensure_weight_tying``)."""
    resolved = {name: TrainableTokens(ids, name) for name, ids in tokens.items()}
    if not spec.tie_word_embeddings or "embed_tokens" not in tokens:
        return resolved
    head = tokens.get("lm_head")
    if head is not None and head != tokens["embed_tokens"]:
        if ensure_tying:
            raise AdapterConfigError(
                adapter, "ensure_weight_tying with different trainable tokens for tied embed_tokens and lm_head"
            )
        return resolved
    resolved["lm_head"] = TrainableTokens(tokens["embed_tokens"], "embed_tokens")
    return resolved


def check_vocab_module(name: str, rank: int, spec: BaseModelSpec, adapter: str, max_rank: int, what: str) -> None:
    """Refuse a vocabulary module the served model cannot take: unknown vocabulary, or a rank past ``max_rank``."""
    if spec.vocab_size <= 0:
        raise UnsupportedAdapterError(adapter, f"{what} on {name}: the served model's vocabulary size is unknown")
    if rank > max_rank:
        raise RankTooLargeError(adapter, f"{what} on {name} needs rank {rank} > max_rank {max_rank}")


def check_token_ids(name: str, ids: tuple[int, ...], spec: BaseModelSpec, adapter: str) -> None:
    bad = [i for i in ids if not 0 <= i < spec.vocab_size]
    if bad:
        raise AdapterConfigError(
            adapter, f"trainable tokens {bad} on {name} lie outside the vocabulary of {spec.vocab_size}"
        )
