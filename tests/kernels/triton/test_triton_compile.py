"""The Triton kernels compile for the GPU that is not here: PTX and a cubin (Triton's bundled ptxas) for sm_90, the
H200, at every shipped block-size entry (and the paged decode attention), in their own process (this one imported
triton in interpret mode). Catches what the interpreter forgives: types across branches, tl.dot shapes and dtypes,
constexpr use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter_manager.kernels.triton.block_sizes import TritonBlockTable

ROOT = Path(__file__).resolve().parents[3]


def test_every_kernel_compiles_for_sm_90():
    pytest.importorskip("triton", reason="triton is not installed (the 'triton' extra)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to silence its warning
    out = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton._triton_aot", "90"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    entries = TritonBlockTable.load().entries
    expected = sum(2 if e.op.startswith("sgmv") else 1 for e in entries)  # SGMV in bf16 and fp32 (ieee tl.dot)
    expected += 2  # the paged decode attention, bf16 and fp32
    assert f"compiled {expected} kernels for sm_90" in out.stdout
