"""Build (once per machine) and load the CPU kernels: ``torch.ops.adapter_manager.lora_apply`` (the LoRA of a fused
linear), ``lora_linear`` (a decode linear's base matmul with its LoRA), ``lora_blocked`` (a linear on our blocked weight
layout with its LoRA, any number of tokens), ``lora_onednn`` (the same on a oneDNN-packed
weight: oneDNN's linear, then lora_apply, in one call) and the decode step's glue ops
(``decode_attention``, ``add_rms_norm``, ``silu_mul``: kernels.cpu_decode).

The sources are ``kernels/csrc/lora_cpu.cpp``, ``linear_cpu.cpp``, ``blocked_cpu.cpp`` and ``decode_cpu.cpp`` (with
their headers ``lora_common.h`` and ``vec16.h``), one library. It is compiled by
torch's own extension builder (``torch.utils.cpp_extension``: the system C++ compiler and ninja) for this machine's
CPU (``-march=native``) on first use, about 10 s (logged at INFO), into ``$ADAPTER_MANAGER_KERNEL_CACHE`` (default
``~/.cache/adapter_manager/kernels``), one folder per (sources, flags, torch, CPU) hash, so a stale build is never
loaded. Later processes load the built library in milliseconds. Where it cannot be built (no compiler) :func:`load`
returns False and says why once; the backend seam then keeps the torch forms, and the model its torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

_log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(_CSRC / name for name in ("lora_cpu.cpp", "linear_cpu.cpp", "blocked_cpu.cpp", "decode_cpu.cpp"))
HEADERS = tuple(_CSRC / name for name in ("vec16.h", "lora_common.h"))  # included by the sources: in the build's hash
CACHE_ENV = "ADAPTER_MANAGER_KERNEL_CACHE"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_OPS = ("lora_apply", "lora_linear", "lora_onednn", "lora_blocked", "decode_attention", "add_rms_norm", "silu_mul")

_lock = threading.Lock()
_loaded: bool | None = None
_op = None  # torch.ops.adapter_manager.lora_apply.default, once loaded
_linear_op = None  # torch.ops.adapter_manager.lora_linear.default, once loaded
_onednn_op = None  # torch.ops.adapter_manager.lora_onednn.default, once loaded
_blocked_op = None  # torch.ops.adapter_manager.lora_blocked.default, once loaded
_reason: str | None = None
build_seconds: float | None = None
"""Seconds this process spent building (None: loaded a build already on disk, or not loaded)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _name() -> str:
    digest = hashlib.sha256()
    files = (path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (*files, " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode()):
        digest.update(part)
    digest.update(_cpu_flags().encode())
    return f"adapter_manager_cpu_{digest.hexdigest()[:16]}"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "adapter_manager" / "kernels")


def _build(name: str, folder: Path) -> Path:
    """Compile the extension in a build folder of this process's own, then move the library into ``folder`` with one
    rename: another process sees either no library or a complete one (never a half-linked file)."""
    from torch.utils import cpp_extension

    try:
        import ninja  # the pip package: its binary may not be on PATH when the venv is not activated

        bin_dir = getattr(ninja, "BIN_DIR", None)
    except ImportError:
        bin_dir = None
    old_path = os.environ.get("PATH", "")
    if bin_dir and bin_dir not in old_path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + old_path
    build = folder / f"build-{os.getpid()}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(  # builds and loads the library (torch.ops.adapter_manager.*) into this process
            name,
            [str(source) for source in SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
        os.replace(build / f"{name}.so", folder / f"{name}.so")
    finally:
        os.environ["PATH"] = old_path
        shutil.rmtree(build, ignore_errors=True)
    return folder / f"{name}.so"


def load() -> bool:
    """Whether the ``torch.ops.adapter_manager`` ops are available; builds or loads the library on the first call."""
    global _loaded, _reason, build_seconds
    with _lock:
        if _loaded is not None:
            return _loaded
        try:
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
            name = _name()
            folder = cache_dir() / name
            library = folder / f"{name}.so"
            if library.exists():
                torch.ops.load_library(str(library))
            else:
                start = time.perf_counter()
                _build(name, folder)
                build_seconds = time.perf_counter() - start
                _log.info("built the CPU LoRA kernel in %.1f s (%s)", build_seconds, folder)
            missing = [op for op in _OPS if not hasattr(torch.ops.adapter_manager, op)]
            if missing:
                raise RuntimeError(f"{library} loaded but registers no adapter_manager::{', '.join(missing)}")
            _loaded = True
        except Exception as err:  # noqa: BLE001 - any build failure means: keep the torch forms
            _loaded, _reason = False, f"{type(err).__name__}: {err}"
            _log.warning("CPU LoRA kernel unavailable, using the torch forms: %s", _reason)
        return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`load` returned False (None when it did not, or was not called)."""
    return _reason


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bts: list[torch.Tensor], runs: torch.Tensor) -> None:
    """``y[:, part p's columns] += (x @ A_p[rows].T) @ Bt_p[rows]`` per run; see the C++ source. :func:`load` first."""
    global _op
    if _op is None:
        _op = torch.ops.adapter_manager.lora_apply.default  # resolved once: the namespace lookup costs per call
    _op(y, x, a, bts, runs)


LINEAR_MAX_TOKENS = 16
"""The most tokens :func:`lora_linear` takes (kLinearTokens in the C++ source)."""

_NO_RUNS = torch.zeros(0, 4, dtype=torch.int64)


def lora_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor | None,
) -> torch.Tensor:
    """``y = x @ w.T`` with each group's LoRA added inside the same call (fp32, T <= :data:`LINEAR_MAX_TOKENS`): group
    g's parts ``a_groups[g]`` [N, P_g, in] and their Bt (``bts``, every group's parts in order) own y's columns from
    ``offsets[g]`` on; ``runs`` None or empty: the base matmul only. See the C++ source. :func:`load` first."""
    global _linear_op
    if _linear_op is None:
        _linear_op = torch.ops.adapter_manager.lora_linear.default
    return _linear_op(x, w, a_groups, bts, offsets, _NO_RUNS if runs is None else runs)


def lora_onednn(
    x: torch.Tensor,
    packed: torch.Tensor,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor,
) -> torch.Tensor:
    """``y = x @ W.T`` through oneDNN's linear on the packed W (``runtime.model.packed.packed_linear``), then each
    group's :func:`lora_apply` onto its columns (groups as :func:`lora_linear`'s), in one call: the same values as
    those calls one by one. Any number of tokens, the dtypes oneDNN packs. :func:`load` first."""
    global _onednn_op
    if _onednn_op is None:
        _onednn_op = torch.ops.adapter_manager.lora_onednn.default
    return _onednn_op(x, packed, a_groups, bts, offsets, runs)


BLOCK = 32
"""Columns per block of :func:`block_weight`'s layout (kBlock in ``blocked_cpu.cpp``)."""


def block_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, in] in the blocked layout :func:`lora_blocked` streams: ``wb[b, k, c] = W[BLOCK·b + c, k]``, zero past N.
    Shape: w [N, in]; returns a new contiguous [ceil(N / BLOCK), in, BLOCK]."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.detach(), (0, 0, 0, -n % BLOCK))
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


def unblock_weight(wb: torch.Tensor, n: int) -> torch.Tensor:
    """The plain [n, in] weight back from :func:`block_weight`'s layout."""
    return wb.transpose(1, 2).reshape(-1, wb.shape[1])[:n].contiguous()


def lora_blocked(
    x: torch.Tensor,
    wb: torch.Tensor,
    n: int,
    a_groups: Sequence[torch.Tensor],
    bts: Sequence[torch.Tensor],
    offsets: Sequence[int],
    runs: torch.Tensor | None,
) -> torch.Tensor:
    """Semantics: ``y = x @ W.T`` for W [n, in] held as :func:`block_weight`'s ``wb``, plus each group's
    :func:`lora_apply` onto its columns (groups as :func:`lora_linear`'s; ``runs`` None or empty: the base matmul
    only), in one call. Any number of tokens, fp32: runs of 16+ tokens in a step of more than 16 (prefill) take their
    LoRA inside the GEMM, the others lora_apply's loops after it. See the C++ source. :func:`load` first.
    Shape: x [T, in]; returns a new [T, n]."""
    global _blocked_op
    if _blocked_op is None:
        _blocked_op = torch.ops.adapter_manager.lora_blocked.default
    return _blocked_op(x, wb, n, a_groups, bts, offsets, _NO_RUNS if runs is None else runs)
