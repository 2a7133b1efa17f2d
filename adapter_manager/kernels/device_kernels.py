"""A device's layer kernels: the model's ops besides its LoRA terms — a linear's base matmul in the layout its weight
is held in (vLLM's ``quant_method``), the weights' packing and quantization, the decode step's glue
(:class:`DecodeOps`) and paged attention. :class:`LayerKernels` holds the torch forms (any device); each platform
(:mod:`kernels.platform`) holds its own: the cpu room's :class:`kernels.cpu.layer_kernels.CpuLayerKernels` reads our
blocked fp32 layout, oneDNN's and int8 with its C++ library and runs the C++ decode glue; the triton room's
:class:`kernels.triton.layer_kernels.CudaLayerKernels` adds the Triton paged decode attention; XLA's keeps the norms'
unfused math."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapter_manager.kernels.layer_reference import RowwiseDecodeOps, TorchDecodeOps, rowwise_linear
from adapter_manager.kernels.protocol import DecodeOps, LayoutReport, LinearWeight, WeightLayout
from adapter_manager.kernels.quantize import dequantize_int8, int8_matmul, quantize_int8


class LayerKernels:
    """A device's base matmuls, weight layouts and decode glue: the torch forms (plain weights; int8 dequantized
    inside the matmul). ``deterministic``: each token's matmuls and norms alone (:func:`rowwise_linear`,
    :class:`RowwiseDecodeOps`), so no result depends on the batch's shape."""

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic

    def decode_ops(self, like: torch.Tensor, compiled: bool = True) -> DecodeOps:
        """The decode glue for tensors like ``like``: compiled where the device has it and ``compiled`` (its
        ``compiled`` True), else the torch forms."""
        return RowwiseDecodeOps() if self.deterministic else TorchDecodeOps()

    def linear(self, x: torch.Tensor, weight: LinearWeight, fast: bool = False, reorder: bool = True) -> torch.Tensor:
        """Semantics: ``x @ W.T`` whichever layout W is held in. ``fast``: the compiled decode glue is on (a CPU
        decode step's plain fp32 weight may take the library's decode linear). ``reorder``: a plain weight may be
        reordered for oneDNN's linear at this call (False for a tied lm_head). Shape: x [T, in]; returns a new
        [T, weight.out_features]."""
        if weight.layout is WeightLayout.INT8:
            assert weight.scales is not None
            return int8_matmul(x, weight.tensor, weight.scales)
        return rowwise_linear(x, weight.tensor) if self.deterministic else x @ weight.tensor.t()

    def plain_matmul(self, x: torch.Tensor, weight: LinearWeight) -> bool:
        """Whether :meth:`linear` of ``x`` is torch's own ``x @ W.T``: then a caller may write its LoRA terms first
        and add the base matmul on top with one ``addmm_``."""
        return weight.layout is WeightLayout.PLAIN and not self.deterministic

    def pack(self, weight: torch.Tensor, layout: WeightLayout | None = None) -> LinearWeight | None:
        """``weight`` [out, in] as a new copy in ``layout``; None where the plain layout stays (here: always)."""
        return None

    def quantize(self, weight: torch.Tensor) -> LinearWeight:
        """``weight`` [out, in] as weight-only int8 with one scale per output row (:mod:`kernels.quantize`)."""
        q, scales = quantize_int8(weight, weight.dtype)
        return LinearWeight(WeightLayout.INT8, q, weight.shape[0], scales)

    def unpack(self, weight: LinearWeight) -> torch.Tensor:
        """The plain ``[out, in]`` weight back from any layout (an int8 one dequantized)."""
        if weight.layout is WeightLayout.INT8:
            assert weight.scales is not None
            return dequantize_int8(weight.tensor, weight.scales)
        return weight.tensor

    def choose_layout(self, dtype: torch.dtype, shapes: Sequence[tuple[int, int, int]]) -> LayoutReport | None:
        """The layout base weights of ``shapes`` (out, in, count) in ``dtype`` read fastest in, and how it was chosen;
        None: the plain layout, nothing to choose (here)."""
        return None

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """Causal GQA attention of each token over its sequence's cached keys read in place through the block tables
        (no gather), where the device has a kernel (:class:`CudaLayerKernels`); None: the caller gathers and runs
        SDPA. ``rows`` None: token t reads table row t. Semantics and shapes:
        :class:`kernels.triton.attention.PagedAttention`."""
        return None
