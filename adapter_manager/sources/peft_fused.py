"""PEFT adapters on fused projections (Phi-3's ``qkv_proj``, ``gate_up_proj``), read as adapters on their parts.

A LoRA on a fused module computes ``Δy = s · x Aᵀ Bᵀ`` over the parts' outputs side by side, so part p's slice of it
is ``s · x Aᵀ B_pᵀ`` with ``B_p`` the part's rows of B: the same A for every part, B (and a per-output vector: the
LoRA bias, DoRA's magnitude, each output row's own) split by rows. :class:`UnfusedHandle` shows an adapter's
safetensors file that way, so validation and preparation see only the parts' keys.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..base_model import FUSED_PROJECTIONS, BaseModelSpec

_FUSED = "|".join(FUSED_PROJECTIONS)
_FUSED_KEY = re.compile(rf"(?P<head>.*\.layers\.\d+\.(?:self_attn|mlp)\.)(?P<fused>{_FUSED})\.(?P<tail>.+)")
_SHARED = ("lora_A.weight",)  # the tensors every part shares whole; the others are split by output rows


class _Slice:
    """A part's tensor as ``safe_open(...).get_slice`` describes it (shape and dtype)."""

    def __init__(self, shape: list[int], dtype: str) -> None:
        self._shape, self._dtype = shape, dtype

    def get_shape(self) -> list[int]:
        return self._shape

    def get_dtype(self) -> str:
        return self._dtype


class UnfusedHandle:
    """A ``safe_open`` handle whose fused-module tensors read as their parts' (``...qkv_proj.lora_B.weight`` ->
    ``...q_proj.lora_B.weight`` rows 0..q, ``...k_proj...`` the next, ...); every other key is the file's own."""

    def __init__(self, handle: Any, spec: BaseModelSpec) -> None:
        self._handle = handle
        self._parts: dict[str, tuple[str, int, int, bool]] = {}  # part key -> (fused key, first row, rows, last)
        self._keys: list[str] = []
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _FUSED_KEY.fullmatch(key) if spec.fused_projections else None
            if match is None:
                self._keys.append(key)
                continue
            start, parts = 0, FUSED_PROJECTIONS[match["fused"]]
            for proj in parts:  # A: first row -1 (every part reads it whole)
                width = spec.projection_shape(proj)[1]
                part_key = f"{match['head']}{proj}.{match['tail']}"
                shared = match["tail"] in _SHARED
                self._parts[part_key] = (key, -1 if shared else start, width, proj == parts[-1])
                self._keys.append(part_key)
                start += width

    def keys(self) -> list[str]:
        return list(self._keys)

    def get_slice(self, key: str) -> _Slice:
        if key not in self._parts:
            return self._handle.get_slice(key)
        fused, start, width, last = self._parts[key]
        whole = self._handle.get_slice(fused)
        shape = list(whole.get_shape())
        if start >= 0 and shape:  # the rows it holds of the file's: a misshapen B shows in some part's shape
            rest = max(0, shape[0] - start)
            shape[0] = rest if last else min(width, rest)
        return _Slice(shape, whole.get_dtype())

    def get_tensor(self, key: str) -> torch.Tensor:
        if key not in self._parts:
            return self._handle.get_tensor(key)
        fused, start, width, _ = self._parts[key]
        tensor = self._handle.get_tensor(fused)
        return tensor if start < 0 else tensor[start : start + width].clone()
