"""Background thread pools that never take compute threads from the engine.

A thread that runs one parallel torch op (a slot copy, a scale fold) keeps an OpenMP team of its own alive; with
more OpenMP threads than cores, GCC's OpenMP runtime drops its spin count and the engine's parallel regions wake
slowly (measured: a main-thread loop 1.9 -> 2.6 ms per iteration with two idle helper threads). Background workers
therefore run their torch ops on one intra-op thread: the engine keeps every core, and the total of OpenMP teams
stays within the cores.

Prefetch workers also run at the lowest CPU priority (nice 19, Linux): on a machine whose cores the engine's OpenMP
team keeps busy, a preparation running beside a step at equal priority takes a core from the team mid-region and the
whole region waits for it (measured, scripts/bench_cold.py on 2 cores: a step with a rank-64 preparation beside it 2.4x
the largest step without one at nice 0, 0.84x at nice 19). At nice 19 the workers run in the cores' idle moments
(the engine's single-threaded Python between parallel regions) and still get a share when there are none, so they
cannot starve. Not SCHED_IDLE: a worker holding the GIL there stalls the engine thread behind it (1.6 s steps).

Not ``torch.set_num_threads(1)``: besides this thread's OpenMP setting it stores the process-wide count that every
thread initialising later (the engine's, if it has not run a parallel op yet) takes as its own. Only the worker's
own OpenMP setting is changed here, after torch's lazy per-thread initialisation (which would reset it).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

PREFETCH_NICE = 19  # CPU priority of prefetch workers: the lowest, so their moves take only the engine's idle time


def _one_intra_op_thread(nice: int) -> None:
    if nice and sys.platform == "linux":  # Linux: a thread id names one thread of the process
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    torch.get_num_threads()  # torch's per-thread initialisation first: it would overwrite what follows
    try:
        omp_set_num_threads = ctypes.CDLL(None).omp_set_num_threads
    except AttributeError:  # torch without OpenMP: its intra-op pool is shared, nothing to oversubscribe
        return
    omp_set_num_threads(1)


def background_executor(workers: int, name: str, nice: int = 0) -> ThreadPoolExecutor:
    """A thread pool whose workers run torch ops single-threaded, at CPU priority `nice` (Linux; the prefetcher's
    run at `PREFETCH_NICE`; registrations and pins, which a caller waits for, at the engine's own)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_one_intra_op_thread, initargs=(nice,))
