"""The roofline references a model's step is judged against, as closures run in the same round-robin as the model's
steps (so contention hits both): the decode step's weight matmuls alone done every way this machine allows, one read
pass over the same bytes (the memory floor), and the machine's GEMM throughput for prefill."""

from __future__ import annotations

from collections.abc import Callable

import torch

from adapter_manager.kernels import cpu as cpu_kernels
from adapter_manager.kernels.cpu import weights as packing
from adapter_manager.runtime.model.llama import Llama
from scripts.harness.steps import base_linears


class References:
    """The references of ``plain``'s weights at M = ``seqs`` (decode) and M = 1024 (prefill's GEMM)."""

    def __init__(self, plain: Llama, seqs: int) -> None:
        weights = [m.weight.detach() for m in base_linears(plain)]
        packs = [packing.onednn_pack(w) for w in weights] if packing.can_pack(weights[0]) else []
        fp32 = weights[0].dtype == torch.float32 and cpu_kernels.load()
        blocks = [cpu_kernels.block_weight(w) for w in weights] if fp32 else []
        inputs = {w.shape[1]: torch.randn(seqs, w.shape[1], dtype=w.dtype) for w in weights}
        self.decode: dict[str, Callable[[], object]] = {
            "ref/x_wt": lambda: [inputs[w.shape[1]] @ w.t() for w in weights],
            "ref/w_xt": lambda: [w @ inputs[w.shape[1]].t() for w in weights],
        }
        if packs:
            self.decode["ref/onednn"] = lambda: [
                packing.onednn_linear(inputs[w.shape[1]], p) for w, p in zip(weights, packs, strict=True)
            ]
        if blocks:
            self.decode["ref/blocked"] = lambda: [
                packing.packed_linear(inputs[w.shape[1]], b, w.shape[0]) for w, b in zip(weights, blocks, strict=True)
            ]
        self.nbytes = sum(w.numel() * w.element_size() for w in weights)
        flat = torch.cat([w.reshape(-1) for w in weights])  # one contiguous copy of the weights' bytes
        self.decode["ref/read"] = lambda: flat.sum()
        largest = max(range(len(weights) - 1), key=lambda i: weights[i].numel())  # a layer's projection
        big = weights[largest]
        self.gemm_flops = 2 * 1024 * big.numel()
        x = torch.randn(1024, big.shape[1], dtype=big.dtype)
        self.prefill: dict[str, Callable[[], object]] = {"ref/gemm_x_wt": lambda: x @ big.t()}
        if packs:
            self.prefill["ref/gemm_onednn"] = lambda: packing.onednn_linear(x, packs[largest])
        if blocks:
            self.prefill["ref/gemm_blocked"] = lambda: packing.packed_linear(x, blocks[largest], big.shape[0])

    def summary(self, decode: dict[str, float], prefill: dict[str, float]) -> dict[str, float]:
        """The references' figures from the medians (ms) of the closures in ``decode`` and ``prefill``."""
        chains = {k.removeprefix("ref/"): v for k, v in decode.items() if k.startswith("ref/") and k != "ref/read"}
        gemm = {k.removeprefix("ref/"): v for k, v in prefill.items() if k.startswith("ref/")}
        out = {f"matmul_chain_{name}_ms": ms for name, ms in chains.items()}
        out["matmul_ref_ms"] = min(chains.values())
        out["read_pass_ms"] = decode["ref/read"]
        out["read_gb_s"] = self.nbytes / decode["ref/read"] / 1e6
        out.update({f"{name}_ms": ms for name, ms in gemm.items()})
        out["gemm_gflop_s"] = self.gemm_flops / min(gemm.values()) / 1e6
        out["base_weight_bytes"] = self.nbytes
        return out
