"""The CPU's layer kernels: base matmuls in our blocked fp32 layout, oneDNN's, int8 and plain (the decode linear of
the C++ library for few tokens), the layout measured per machine, and the C++ decode glue."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapter_manager.kernels.cpu import decode_ops, layout_choice, weights
from adapter_manager.kernels.cpu.library import load
from adapter_manager.kernels.cpu.linear_ops import fixed_linear
from adapter_manager.kernels.device_kernels import LayerKernels
from adapter_manager.kernels.protocol import DecodeOps, LinearWeight, WeightLayout


class CompiledDecodeOps:
    """:class:`DecodeOps` as the C++ library's ops (:mod:`kernels.cpu.decode_ops`)."""

    compiled = True
    """The decode-only attention op beats the model's batched attention: a decode step takes it."""
    decode_attention = staticmethod(decode_ops.decode_attention)
    add_rms_norm = staticmethod(decode_ops.add_rms_norm)
    silu_mul = staticmethod(decode_ops.silu_mul)
    gelu_tanh_mul = staticmethod(decode_ops.gelu_tanh_mul)


class CpuLayerKernels(LayerKernels):
    """:class:`LayerKernels` on CPU. ``deterministic``: every base matmul is :func:`kernels.cpu.fixed_linear` on a
    plain weight (each token's outputs summed in an order fixed by the shapes alone), or one token per matmul where
    the C++ library is not built."""

    def decode_ops(self, like: torch.Tensor, compiled: bool = True) -> DecodeOps:
        """The C++ decode glue where it serves tensors like ``like`` (the library built) and ``compiled``, else the
        torch forms."""
        if compiled and decode_ops.available(like):
            return CompiledDecodeOps()
        return super().decode_ops(like, compiled)

    def linear(self, x: torch.Tensor, weight: LinearWeight, fast: bool = False, reorder: bool = True) -> torch.Tensor:
        """Semantics: :meth:`kernels.layer_ops.LayerKernels.linear` (:func:`kernels.cpu.weights.linear`; deterministic:
        :func:`kernels.cpu.fixed_linear`)."""
        if self.deterministic:
            if weight.layout is not WeightLayout.PLAIN:
                raise ValueError(f"the deterministic mode reads plain weights, not {weight.layout.value} ones")
            if not load():
                return super().linear(x, weight)
            return fixed_linear(x if x.stride(1) == 1 else x.contiguous(), weight.tensor, (), (), (), None)
        return weights.linear(x, weight, fast, reorder)

    def plain_matmul(self, x: torch.Tensor, weight: LinearWeight) -> bool:
        return not self.deterministic and weights.plain_matmul(x, weight)

    def pack(self, weight: torch.Tensor, layout: WeightLayout | None = None) -> LinearWeight | None:
        return weights.pack(weight, layout)

    def quantize(self, weight: torch.Tensor) -> LinearWeight:
        return weights.quantize(weight)

    def unpack(self, weight: LinearWeight) -> torch.Tensor:
        return weight.tensor if weight.layout is WeightLayout.PLAIN else weights.unpack(weight)

    def choose_layout(self, dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]]) -> layout_choice.LayoutChoice:
        return layout_choice.choose_layout(dtype, shapes)

    @staticmethod
    def packs_by_default() -> bool:
        return weights.pack_by_default()
