"""Build (once per machine) and load the CPU backend's C++ library: ``torch.ops.adapter_manager.lora_apply`` (the LoRA
of a fused linear), ``lora_linear`` (a plain fp32 decode linear's base matmul with its LoRA), ``q8_linear`` (a linear
on an int8 weight with a scale per output row), ``lora_blocked`` (a linear on our blocked weight layout with its
LoRA, any number of tokens), ``lora_onednn`` (the same on a oneDNN-packed weight: oneDNN's linear, then lora_apply,
in one call) — wrapped in :mod:`kernels.cpu.linear_ops` — and the decode step's glue
ops ``decode_attention``, ``add_rms_norm``, ``silu_mul`` (:mod:`kernels.cpu.decode_ops`).

The sources are ``kernels/cpu/csrc/<op>.cpp``, one per op (with the headers ``lora_common.h`` and ``vec16.h``), one
library. It is compiled by torch's own extension builder (``torch.utils.cpp_extension``: the system C++ compiler and
ninja) for this machine's CPU (``-march=native``) on first use, about 10 s on 8 cores, under a minute on 2 (announced
as it starts on the ``adapter_manager.progress`` logger, which the command line shows; its time logged at INFO),
into ``$ADAPTER_MANAGER_KERNEL_CACHE`` (default ``~/.cache/adapter_manager/kernels``), one folder per (sources,
flags, torch, CPU) hash, so a stale build is never loaded. Later processes load the built library in milliseconds.
Where it cannot be built (no compiler) :func:`load` returns False and says why once; the backend seam then keeps the
torch forms, and the model its torch ops.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

_log = logging.getLogger(__name__)
_progress = logging.getLogger("adapter_manager.progress")  # long steps, said as they start; the CLI shows them

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = {  # each source and the ops it registers (one op each, named after it; gated_mul: both activations)
    "lora_apply": ("lora_apply",), "lora_onednn": ("lora_onednn",), "lora_linear": ("lora_linear",),
    "lora_blocked": ("lora_blocked",), "q8_linear": ("q8_linear",), "decode_attention": ("decode_attention",),
    "add_rms_norm": ("add_rms_norm",), "gated_mul": ("silu_mul", "gelu_tanh_mul"), "fixed_linear": ("fixed_linear",),
    "vector_epilogue": ("vector_epilogue",),
}  # fmt: skip
_OPS = tuple(op for ops in _SOURCES.values() for op in ops)
SOURCES = tuple(_CSRC / f"{source}.cpp" for source in _SOURCES)
HEADERS = tuple(_CSRC / name for name in ("vec16.h", "lora_common.h", "decode_common.h"))  # in the build's hash too
CACHE_ENV = "ADAPTER_MANAGER_KERNEL_CACHE"
# -fno-trapping-math: without it GCC 12 will not if-convert a float min / max (exp_poly's clamp), so the decode glue's
# exp loops (silu_mul, the attention's softmax) stay scalar; it changes no result (no reassociation, no fast-math).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
_LDFLAGS = ["-fopenmp"]
_SOURCE_SECONDS = 10  # about how long one source takes to compile on one core (for the announced estimate)


_lock = threading.Lock()
_loaded: bool | None = None
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
                cores = os.cpu_count() or 1
                estimate = _SOURCE_SECONDS * math.ceil(len(SOURCES) / cores)
                _progress.info("compiling the CPU kernels (once per machine: ~%d s on %d cores)...", estimate, cores)
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
