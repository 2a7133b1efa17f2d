"""Compile the Triton kernels ahead of time for a GPU that is not here (``python -m tests.kernels.triton._triton_aot``):
Triton lowers them to PTX and its bundled ptxas to a cubin, for the NVIDIA target given (default sm_90, the H200),
at every shipped block-size entry. Needs TRITON_INTERPRET unset (tests/kernels/test_triton_compile.py runs it in its
own process)."""

from __future__ import annotations

import inspect
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adapter_manager.kernels.triton import attention as triton_attention
from adapter_manager.kernels.triton import kernels as triton_kernels
from adapter_manager.kernels.triton.block_sizes import TritonBlockTable

POINTERS = {"h_ptr": "*fp32", "tok_ptr": "*i32", "runs_ptr": "*i32", "tab_ptr": "*i64", "rows_ptr": "*i64",
            "pos_ptr": "*i64"}  # fmt: skip
"""Pointer arguments of a fixed type; every other ``*_ptr`` has the serving dtype."""


def signature(fn, dtype: str) -> dict[str, str]:
    """Triton's signature of a kernel body: pointers, i64 part offsets, i32 sizes and strides, its constexprs."""
    out = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.annotation in (tl.constexpr, "tl.constexpr"):
            out[name] = "constexpr"
        elif name.endswith("_ptr"):
            out[name] = POINTERS.get(name, f"*{dtype}")
        else:
            out[name] = "i64" if name in ("off1", "off2") else "fp32" if name == "scale" else "i32"
    return out


PAGED = {"GROUP": 4, "BLOCK_G": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "BLOCK_S": 16}
"""The paged decode attention's constexprs for Llama-3-8B's shape (32 heads over 8 KV heads, head 128, 16-token
blocks)."""


def constexprs(op: str, blocks, dtype: str) -> dict[str, object]:
    """The constexprs the backend passes for one table entry (rank 64, one rank block for SGMV; two parts)."""
    precision = "ieee" if dtype == "fp32" else None
    if op == "bgmv_shrink":
        return {"BLOCK_R": blocks.block_rank, "BLOCK_K": blocks.block_features, "SPLIT_K": blocks.split_k}
    if op == "bgmv_expand":
        return {"BLOCKS0": 4, "BLOCKS1": 2, "BLOCK_R": blocks.block_rank, "BLOCK_N": blocks.block_features}
    common = {"BLOCK_T": blocks.block_tokens, "BLOCK_R": max(16, blocks.block_rank), "PRECISION": precision}
    if op == "sgmv_shrink":
        return {**common, "RANK_BLOCKS": 1, "BLOCK_K": blocks.block_features, "UPCAST": False}
    return {**common, "BLOCKS0": 4, "BLOCKS1": 2, "BLOCK_N": blocks.block_features, "UPCAST": False}


def main(arch: int = 90) -> int:
    target, compiled = GPUTarget("cuda", arch, 32), 0
    for entry in TritonBlockTable.load().entries:
        fn = getattr(triton_kernels, f"_{entry.op}")
        for dtype in ("bf16", "fp32") if entry.op.startswith("sgmv") else ("bf16",):
            source = ASTSource(
                fn=triton.jit(fn), signature=signature(fn, dtype), constexprs=constexprs(entry.op, entry.blocks, dtype)
            )
            kernel = triton.compile(source, target=target, options={"num_warps": entry.blocks.num_warps})
            assert kernel.asm.get("cubin"), f"{entry.op} {dtype}: no cubin"
            compiled += 1
    fn = triton_attention._paged_decode  # noqa: SLF001 - the kernel body
    for dtype in ("bf16", "fp32"):
        source = ASTSource(fn=triton.jit(fn), signature=signature(fn, dtype), constexprs=PAGED)
        kernel = triton.compile(source, target=target, options={"num_warps": 4})
        assert kernel.asm.get("cubin"), f"paged attention {dtype}: no cubin"
        compiled += 1
    print(f"compiled {compiled} kernels for sm_{arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90))
