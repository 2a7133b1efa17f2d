"""The serving process's C heap (`heap_trim`): the pages that glibc's arenas keep after blocks of a few hundred KiB
were freed go back to the system while the server runs, as they did not before the trimmer (the soak's RSS growth)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapter_manager.runtime.server.heap_trim import HeapTrimmer, malloc_trim

# In a fresh interpreter, glibc's pattern under churn: a freed 4 MiB block raises the mmap threshold, so 64 blocks of
# 512 KiB come from an arena, each followed by a 48 KiB block kept alive (the heap cannot shrink from its top); the
# big ones freed, their 32 MiB stay resident. Then (mode "trim") a trimmer runs for a moment. Prints RSS in MiB.
_PROBE = """
import ctypes, json, sys, time
from adapter_manager.runtime.server.heap_trim import HeapTrimmer
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
libc.free(libc.malloc(4 << 20))
big, small = [], []
for _ in range(64):
    block = libc.malloc(512 << 10)
    ctypes.memset(block, 1, 512 << 10)
    big.append(block)
    small.append(libc.malloc(48 << 10))
before = rss()
for block in big:
    libc.free(block)
freed = rss()
if sys.argv[1] == "trim":
    trimmer = HeapTrimmer(interval_s=0.05).start()
    time.sleep(0.5)
    trimmer.stop()
print(json.dumps({"before": before, "freed": freed, "after": rss()}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_the_trimmer_hands_back_what_the_arenas_keep() -> None:
    kept = _probe("keep")
    assert kept["before"] - kept["after"] < 8  # freed, yet resident: what the soak's RSS grew from
    trimmed = _probe("trim")
    assert trimmed["before"] - trimmed["after"] > 24  # of the 32 MiB freed


def test_the_trimmer_counts_its_work_and_stops() -> None:
    trimmer = HeapTrimmer(interval_s=0.01).start()
    try:
        while trimmer.trims < 3 and malloc_trim() is not None:
            pass
    finally:
        trimmer.stop()
    assert trimmer.seconds >= trimmer.longest_s >= 0.0 and trimmer.released <= trimmer.trims
    with pytest.raises(ValueError, match="interval_s"):
        HeapTrimmer(interval_s=0)
