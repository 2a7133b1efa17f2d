"""The vocabulary modules' rows of a prepared adapter: trainable tokens as a one-hot LoRA, and the check of the
frozen table PEFT saves beside an embedding / lm_head LoRA.

Trainable tokens replace rows ``ids`` of a module's ``[V, H]`` weight W (the embedding table, or the head's weight:
the table when tied) by R ``[n, H]`` (`sources.peft_vocab`). That is a LoRA of rank n, scaling 1, in the pool's
vocabulary columns (`row_layout`)::

    embed_tokens:  A [n, V] = onehot(ids),  Bt [n, H] = R - W[ids]    token t: E[t] + Σ_j [t = ids_j] (R_j - E[t])
    lm_head:       A [n, H] = R - W[ids],   Bt [n, V] = onehot(ids)   logit v: h·W[v] + Σ_j [v = ids_j] h·(R_j - W[v])

In fp32 that is R up to one rounding (PEFT's ``index_copy`` gives R exactly); the difference R - W[ids] is taken
in fp32 before the cast to the serving dtype. Both need the served weight: ``base_weight(key)``
(`vectors.BaseWeight`).
"""

from __future__ import annotations

import torch

from ..base_model import ModuleKey
from ..errors import NonFiniteWeightsError, TensorShapeError, UnsupportedAdapterError
from .vectors import BaseWeight

_CHUNK = 4096  # rows of a saved table compared at a time
_COPY_TOLERANCE = 2.0**-7
"""A saved frozen table matches the served one within this fraction of its largest magnitude: the served weight may
be another dtype (bf16: 2^-9 relative) or int8 (half a step of a row's scale, at most 2^-8 of the row's largest)."""


def token_rows(
    key: ModuleKey, ids: tuple[int, ...], rows: torch.Tensor, base_weight: BaseWeight, a: torch.Tensor,
    bt: torch.Tensor, adapter_id: str, tensor_key: str,
) -> None:  # fmt: skip
    """Write trainable tokens' one-hot LoRA into the block's views ``a`` ``[r, in]`` and ``bt`` ``[r, out]`` of
    module ``key`` (rows past n stay zero). Shape: rows [n, H] (the replacement rows)."""
    if not bool(rows.isfinite().all()):
        raise NonFiniteWeightsError(adapter_id, f"tensor {tensor_key!r} holds NaN or infinity")
    index = torch.tensor(ids, dtype=torch.long)
    weight = base_weight(key)  # [V, H]
    delta = rows.to(torch.float32) - weight[index.to(weight.device)].to(device="cpu", dtype=torch.float32)
    positions = torch.arange(len(ids))
    if key.proj == "embed_tokens":
        a[positions, index] = 1
        bt[: len(ids)].copy_(delta)
    else:
        a[: len(ids)].copy_(delta)
        bt[positions, index] = 1
    if not bool(delta.to(a.dtype).isfinite().all()):
        raise NonFiniteWeightsError(adapter_id, f"tensor {tensor_key!r}: its rows minus the base's overflow {a.dtype}")


def check_base_copy(key: ModuleKey, saved: torch.Tensor, base_weight: BaseWeight, adapter_id: str, name: str) -> None:
    """Refuse an adapter whose saved frozen table (``base_layer.weight``, ``[V, H]``) is not the served one: PEFT
    loads it over the model's, so serving it with another table would not be its computation."""
    served = base_weight(key)
    if tuple(saved.shape) != tuple(served.shape):
        raise TensorShapeError(
            adapter_id, f"tensor {name!r} has shape {list(saved.shape)}, the served {key.module_name} "
            f"{list(served.shape)}"
        )  # fmt: skip
    bound = None
    for start in range(0, saved.shape[0], _CHUNK):
        mine = saved[start : start + _CHUNK].to(torch.float32)
        theirs = served[start : start + _CHUNK].to(device="cpu", dtype=torch.float32)
        if bound is None:
            bound = _COPY_TOLERANCE * float(served.abs().max())
        if not bool(((mine - theirs).abs() <= bound).all()):
            raise UnsupportedAdapterError(
                adapter_id, f"tensor {name!r} is not the served model's {key.module_name} weight (PEFT would load it "
                "over the model's: a resized or retrained table is not supported)"
            )  # fmt: skip
