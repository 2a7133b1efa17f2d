"""The soak's heap profile (``--profile-heap``): the soak's server runs with ``ADAPTER_MANAGER_HEAP_PROFILE`` (see
``adapter_manager/runtime/server/heap_profile.py``); ``POST /debug/heap`` is called as the load starts, every
--heap-every seconds and once it stopped (then ``malloc_trim(0)``), and the shot at warm-up is diffed with the last:

- a timeline: RSS (anonymous part), malloc's heap bytes (``arena``: taken from the system by the heaps; ``hblkhd``:
  mmapped chunks), in use and free-but-kept (``uordblks`` / ``fordblks``), the arenas, tracemalloc's traced bytes
  (Python allocations) and the CPU tensor storages reachable from Python (torch);
- the allocation sites (file:line) that grew most between the two snapshots, and the files;
- the mappings whose resident bytes grew most (a file, the heap, shared or other anonymous memory);
- the object types whose live count grew most; what malloc_trim gave back at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV = "ADAPTER_MANAGER_HEAP_PROFILE"
FRAMES_ENV = "ADAPTER_MANAGER_HEAP_FRAMES"
_MIB = 1 << 20
_NOISE = (
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<unknown>"),
)


def heap_env(env: dict[str, str], folder: Path, frames: int) -> dict[str, str]:
    """`env` with the server's heap profile on, its snapshots written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    return {**env, ENV: str(folder), FRAMES_ENV: str(frames)}


@dataclass
class HeapProbe:
    """Heap shots of the server at `url` (its answers, each with ``at``: seconds from :meth:`begin`)."""

    url: str
    every_s: float
    shots: list[dict] = field(default_factory=list)
    _began: float = 0.0

    def begin(self) -> None:
        self._began = time.perf_counter()
        self.take("start")

    def take(self, label: str, trim: bool = False) -> dict:
        """One shot now (the server dumps its tracemalloc snapshot as ``<label>.tracemalloc``)."""
        at = time.perf_counter() - self._began
        query = f"label={label}&traces=true&trim={'true' if trim else 'false'}"
        request = urllib.request.Request(f"{self.url}/debug/heap?{query}", method="POST")
        with urllib.request.urlopen(request, timeout=600) as reply:
            shot = json.loads(reply.read())
        shot["at"] = at
        self.shots.append(shot)
        print(f"heap {label:>8s} at {at:6.0f} s: {_line(shot)} ({shot['seconds']:.1f} s)", flush=True)
        return shot

    async def run(self, session: object, stop: asyncio.Event) -> None:
        """A side of the open loop: a shot every `every_s` seconds until `stop`."""
        n = 1
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, self._began + n * self.every_s - time.perf_counter()))
            except TimeoutError:
                await asyncio.to_thread(self.take, f"t{n:03d}")
                n += 1

    def report(self, warm_s: float, top: int = 25) -> dict[str, Any]:
        """The shot at warm-up (the first at or after `warm_s`) against the last: sites, files, types, totals."""
        last = self.shots[-1]
        warm = next((s for s in self.shots if s["at"] >= warm_s and s is not last), self.shots[0])
        old = tracemalloc.Snapshot.load(warm["tracemalloc"]["snapshot"]).filter_traces(_NOISE)
        new = tracemalloc.Snapshot.load(last["tracemalloc"]["snapshot"]).filter_traces(_NOISE)
        sites = [_stat(s, True) for s in _growing(new.compare_to(old, "lineno"))[:top]]
        files = [_stat(s, False) for s in _growing(new.compare_to(old, "filename"))[:10]]
        kinds = {k: last["objects"].get(k, 0) - warm["objects"].get(k, 0) for k in {*last["objects"], *warm["objects"]}}
        types = dict(sorted(kinds.items(), key=lambda kv: -abs(kv[1]))[:15])
        return {
            "warm_label": warm["label"],
            "end_label": last["label"],
            "timeline": [_row(s) for s in self.shots],
            "deltas_mib": {k: (_row(last)[k] - _row(warm)[k]) for k in _row(last) if k not in ("label", "at")},
            "sites": sites,
            "files": files,
            "types": types,
            "regions": _regions_diff(warm["regions"], last["regions"]),
            "trimmed": last.get("trimmed"),
            "shots": self.shots,
        }


def print_heap(report: dict[str, Any]) -> None:
    rows = report["timeline"]
    print(f"\nheap: {report['warm_label']} (after warm-up) -> {report['end_label']}; MiB")
    names = [k for k in rows[0] if k not in ("label", "at")]
    print(f"  {'shot':>8s} {'at s':>6s} " + " ".join(f"{n:>10s}" for n in names))
    for row in rows:
        print(f"  {row['label']:>8s} {row['at']:6.0f} " + " ".join(f"{row[n]:10.1f}" for n in names))
    print("  delta            " + " ".join(f"{report['deltas_mib'][n]:+10.1f}" for n in names))
    print("growing allocation sites (tracemalloc, KiB; count):")
    for s in report["sites"]:
        now = f"(now {s['size'] / 1024:.0f} KiB, {s['count']})"
        print(f"  {s['size_diff'] / 1024:+10.1f} KiB {s['count_diff']:+8d}  {s['where']}  {now}")
    print("by file:")
    for s in report["files"]:
        print(f"  {s['size_diff'] / 1024:+10.1f} KiB {s['count_diff']:+8d}  {s['where']}")
    print(
        "resident by mapping (change): "
        + ", ".join(f"{k} {v['rss'] / _MIB:+.1f} MiB ({v['mappings']:+d} maps)" for k, v in report["regions"].items())
    )
    print("live objects by type (count change): " + ", ".join(f"{k} {v:+d}" for k, v in report["types"].items()))
    if report["trimmed"]:
        t = report["trimmed"]
        print(f"malloc_trim(0) at the end: RSS {t['rss_before'] / _MIB:.1f} -> {t['rss_after'] / _MIB:.1f} MiB")


def _row(shot: dict) -> dict[str, Any]:
    """One shot's totals in MiB."""
    proc, malloc, traced = shot["proc"], shot["malloc"], shot["tracemalloc"]
    arenas = malloc.get("arenas", {})
    return {
        "label": shot["label"],
        "at": shot["at"],
        "rss": proc["rss"] / _MIB,
        "anon": proc["anon"] / _MIB,
        "shmem": proc["shmem"] / _MIB,
        "file": proc["file"] / _MIB,
        "heaps": malloc.get("arena", 0) / _MIB,
        "mmapped": malloc.get("hblkhd", 0) / _MIB,
        "in_use": malloc.get("uordblks", 0) / _MIB,
        "free": malloc.get("fordblks", 0) / _MIB,
        "arenas": float(arenas.get("count", 0)),
        "python": traced["traced_bytes"] / _MIB,
        "tracemalloc": traced["own_bytes"] / _MIB,
        "torch": shot["torch"].get("cpu", {}).get("bytes", 0) / _MIB,
    }


def _line(shot: dict) -> str:
    row = _row(shot)
    return (
        f"RSS {row['rss']:.0f} MiB (anon {row['anon']:.0f}, shmem {row['shmem']:.0f}); malloc heaps "
        f"{row['heaps']:.0f} (in use {row['in_use']:.0f}, free {row['free']:.0f}, {row['arenas']:.0f} arenas), "
        f"mmapped {row['mmapped']:.0f}; "
        f"python {row['python']:.0f}; torch {row['torch']:.0f}"
    )


def _growing(stats: list[tracemalloc.StatisticDiff]) -> list[tracemalloc.StatisticDiff]:
    return sorted(stats, key=lambda s: -s.size_diff)


def _regions_diff(old: dict, new: dict, top: int = 8) -> dict[str, dict[str, int]]:
    """Resident bytes and mappings by region kind, `new` less `old`; the `top` by the bytes' change."""
    diff = {
        k: {f: new.get(k, {}).get(f, 0) - old.get(k, {}).get(f, 0) for f in ("rss", "mappings")} for k in {*old, *new}
    }
    return dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]["rss"]))[:top])


def _stat(stat: tracemalloc.StatisticDiff, line: bool) -> dict[str, Any]:
    frame = stat.traceback[0]
    return {
        "where": f"{frame.filename}:{frame.lineno}" if line else frame.filename,
        "size_diff": stat.size_diff,
        "count_diff": stat.count_diff,
        "size": stat.size,
        "count": stat.count,
    }
