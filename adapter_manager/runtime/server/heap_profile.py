"""Heap profiling of the server process, for finding what makes its RSS grow. Off unless the environment names a
folder at start-up; off, nothing is started and no route exists.

    ADAPTER_MANAGER_HEAP_PROFILE=/tmp/heap ADAPTER_MANAGER_HEAP_FRAMES=1 adapter-manager serve ...
    POST /debug/heap?label=warm             # the figures below, and /tmp/heap/warm.tracemalloc
    POST /debug/heap?label=end&trim=true    # the same, then malloc_trim(0) and the RSS it gave back

On, tracemalloc traces from the app's creation (FRAMES frames a trace, default 1), and each call answers what tells
Python objects, torch tensors and the C heap apart:

- ``proc``: RSS split anonymous / file-backed / shared memory (``/proc/self/status``), the mappings and threads;
  ``regions``: resident bytes by what is mapped (a file, the heap, shared anonymous memory, anonymous by size);
- ``malloc``: glibc's ``mallinfo2`` (``arena`` bytes taken by the heaps, ``hblkhd`` mmapped chunks, ``uordblks``
  in use, ``fordblks`` free but kept) and ``malloc_info``'s arenas (count, free chunks, system bytes per arena);
- ``tracemalloc``: bytes traced now and at peak, tracemalloc's own memory; the snapshot is dumped to
  ``<folder>/<label>.tracemalloc`` for ``tracemalloc.Snapshot.load`` (the client diffs two);
- ``torch``: the tensor storages reachable from Python objects by device (count, bytes: each storage once);
- ``objects``: live gc-tracked objects by type, the 40 most numerous.

A cyclic collection runs first, so what is counted is alive. With ``trim`` it then calls ``malloc_trim(0)`` and
reports the RSS before and after (``trimmed``): memory freed but kept by malloc comes back, live memory does not.
The route needs the admin token when one is set.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import threading
import time
import tracemalloc
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Header

from .http_errors import APIError

ENV = "ADAPTER_MANAGER_HEAP_PROFILE"
"""The folder snapshots are written to; unset or empty: profiling off."""
FRAMES_ENV = "ADAPTER_MANAGER_HEAP_FRAMES"
"""Frames kept per traced allocation (default 1: file:line sites)."""

_LABEL = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+(.*)$")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )
    ]  # fmt: skip


@dataclass
class HeapProfiler:
    """Tracemalloc, malloc and tensor figures of this process on demand (see the module's doc)."""

    folder: Path  # where ``<label>.tracemalloc`` snapshots are written
    frames: int = 1  # frames kept per traced allocation

    def __post_init__(self) -> None:
        if not 1 <= self.frames <= 100:
            raise ValueError(f"heap profile frames must be in [1, 100], got {self.frames}")
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> HeapProfiler | None:
        """The profiler the environment asks for (``ADAPTER_MANAGER_HEAP_PROFILE``), or None: off."""
        folder = environ.get(ENV, "")
        if not folder:
            return None
        frames = environ.get(FRAMES_ENV, "1")
        if not frames.isdigit():
            raise ValueError(f"{FRAMES_ENV} must be a number of frames, got {frames!r}")
        return cls(Path(folder), int(frames))

    def start(self) -> None:
        """Create the folder and start tracing (a process started with PYTHONTRACEMALLOC already traces)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)

    def snapshot(self, label: str, traces: bool = True, trim: bool = False) -> dict[str, Any]:
        """The process's figures now; with `traces` the tracemalloc snapshot dumped as ``<label>.tracemalloc``,
        with `trim` malloc_trim(0) afterwards. One call at a time."""
        if not _LABEL.fullmatch(label):
            raise ValueError(f"heap snapshot label must match {_LABEL.pattern}, got {label!r}")
        with self._lock:
            began = time.perf_counter()
            collected = gc.collect()
            out: dict[str, Any] = {"label": label, "time": time.time(), "gc_collected": collected}
            out["proc"], out["regions"] = proc_memory(), regions()
            out["malloc"] = malloc_stats()
            current, peak = tracemalloc.get_traced_memory()
            out["tracemalloc"] = {
                "tracing": tracemalloc.is_tracing(),
                "traced_bytes": current,
                "peak_bytes": peak,
                "own_bytes": tracemalloc.get_tracemalloc_memory(),
            }
            if traces and tracemalloc.is_tracing():
                path = self.folder / f"{label}.tracemalloc"
                tracemalloc.take_snapshot().dump(str(path))
                out["tracemalloc"]["snapshot"] = str(path)
            out["torch"], out["objects"] = _objects()
            if trim:
                before = proc_memory()["rss"]
                trimmed = _libc_call("malloc_trim", ctypes.c_int, ctypes.c_size_t)
                gave_back = trimmed(0) if trimmed is not None else None
                out["trimmed"] = {"returned": gave_back, "rss_before": before, "rss_after": proc_memory()["rss"]}
            out["seconds"] = time.perf_counter() - began
            return out


def heap_router(profiler: HeapProfiler, check_admin: Callable[[str | None], None]) -> APIRouter:
    """``POST /debug/heap?label=&traces=&trim=``: :meth:`HeapProfiler.snapshot`, on a worker thread."""

    def require_admin(authorization: str | None = Header(None)) -> None:
        check_admin(authorization)

    router = APIRouter()

    @router.post("/debug/heap", dependencies=[Depends(require_admin)])
    def heap(label: str, traces: bool = True, trim: bool = False) -> dict[str, Any]:
        try:
            return profiler.snapshot(label, traces, trim)
        except ValueError as err:
            raise APIError(400, str(err), "label", "invalid_label") from err

    return router


def proc_memory() -> dict[str, int]:
    """RSS (bytes) and its anonymous / file-backed / shared-memory parts, the peak, the mappings and threads."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "peak"}
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in fields:
                out[fields[key]] = int(rest.split()[0]) * 1024
    with open("/proc/self/maps") as f:
        out["mappings"] = sum(1 for _ in f)
    out["threads"] = threading.active_count()
    out["os_threads"] = len(os.listdir("/proc/self/task"))
    return out


def regions(top: int = 15) -> dict[str, dict[str, int]]:
    """Resident bytes and mappings by what is mapped (``/proc/self/smaps``): a file's path, ``[heap]``, a shared
    anonymous mapping as ``/dev/zero (deleted)``, other anonymous ones as ``[anon <= 2^k]`` by their size; the `top`
    by resident bytes."""
    kinds: dict[str, dict[str, int]] = {}
    key = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = _MAPPING.match(line)
            if head is not None:
                start, end, name = int(head[1], 16), int(head[2], 16), head[3].strip()
                key = name or f"[anon <= 2^{max(end - start - 1, 1).bit_length()}]"
                kinds.setdefault(key, {"rss": 0, "mappings": 0})["mappings"] += 1
            elif line.startswith("Rss:"):
                kinds[key]["rss"] += int(line.split()[1]) * 1024
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]["rss"])[:top])


def malloc_stats() -> dict[str, Any]:
    """glibc's mallinfo2 and malloc_info summed up; ``{"available": False}`` on another libc."""
    mallinfo2 = _libc_call("mallinfo2", _MallInfo2)
    malloc_info = _libc_call("malloc_info", ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    if mallinfo2 is None or malloc_info is None:
        return {"available": False}
    info = mallinfo2()
    out: dict[str, Any] = {"available": True, **{name: getattr(info, name) for name, _ in _MallInfo2._fields_}}
    out["arenas"] = _arenas(malloc_info)
    return out


def _arenas(malloc_info: Callable[[int, int], int]) -> dict[str, Any]:
    """malloc_info's XML as totals: arenas, their system bytes, free chunks (fast and rest), the largest arena."""
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return {}
    try:
        malloc_info(0, stream)
    finally:
        libc.fclose(stream)
    text = ctypes.string_at(buf, size.value).decode()
    libc.free(ctypes.cast(buf, ctypes.c_void_p))
    root = ET.fromstring(text)
    heaps = []
    for heap in root.findall("heap"):
        free = sum(int(t.get("size", 0)) for t in heap.findall("total") if t.get("type") in ("fast", "rest"))
        chunks = sum(int(t.get("count", 0)) for t in heap.findall("total") if t.get("type") in ("fast", "rest"))
        system = next((int(s.get("size", 0)) for s in heap.findall("system") if s.get("type") == "current"), 0)
        heaps.append({"system": system, "free": free, "free_chunks": chunks})
    mmap = next((t for t in root.findall("total") if t.get("type") == "mmap"), None)
    largest = max(heaps, key=lambda h: h["system"], default={"system": 0, "free": 0, "free_chunks": 0})
    return {
        "count": len(heaps),
        "system": sum(h["system"] for h in heaps),
        "free": sum(h["free"] for h in heaps),
        "free_chunks": sum(h["free_chunks"] for h in heaps),
        "largest": largest,
        "mmap_chunks": int(mmap.get("count", 0)) if mmap is not None else 0,
        "mmap_bytes": int(mmap.get("size", 0)) if mmap is not None else 0,
    }


def _libc_call(name: str, restype: Any, *argtypes: Any) -> Any:
    """A function of the C library, or None where it has none (not glibc, or an older one)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)  # the symbols this process loaded: the C library's among them
    except (AttributeError, OSError):
        return None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def _objects() -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(the tensor storages reachable from Python objects by device, ``{"cpu": {"storages", "bytes"}}``, each storage
    once; live gc-tracked objects by type, the 40 most numerous)."""
    import torch  # already loaded by the server; only counted here

    kinds: Counter[str] = Counter()
    storages: dict[str, dict[int, int]] = {}
    for obj in gc.get_objects():
        kind = type(obj)
        kinds[f"{kind.__module__}.{kind.__qualname__}"] += 1
        if issubclass(kind, torch.Tensor):  # type(), not isinstance: no __class__ read (deprecated objects warn)
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
                continue
            storages.setdefault(str(obj.device), {})[storage.data_ptr()] = storage.nbytes()
    by_device = {device: {"storages": len(s), "bytes": sum(s.values())} for device, s in storages.items()}
    return by_device, dict(kinds.most_common(40))
