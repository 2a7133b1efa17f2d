"""Background thread pools that never take compute threads from the engine.

A thread that runs one parallel torch op (a slot copy, a scale fold) keeps an OpenMP team of its own alive; with
more OpenMP threads than cores, GCC's OpenMP runtime drops its spin count and the engine's parallel regions wake
slowly (measured: a main-thread loop 1.9 -> 2.6 ms per iteration with two idle helper threads). Background workers
therefore run their torch ops on one intra-op thread: the engine keeps every core, and the total of OpenMP teams
stays within the cores.

Not ``torch.set_num_threads(1)``: besides this thread's OpenMP setting it stores the process-wide count that every
thread initialising later (the engine's, if it has not run a parallel op yet) takes as its own. Only the worker's
own OpenMP setting is changed here, after torch's lazy per-thread initialisation (which would reset it).
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import torch


def _one_intra_op_thread() -> None:
    torch.get_num_threads()  # torch's per-thread initialisation first: it would overwrite what follows
    try:
        omp_set_num_threads = ctypes.CDLL(None).omp_set_num_threads
    except AttributeError:  # torch without OpenMP: its intra-op pool is shared, nothing to oversubscribe
        return
    omp_set_num_threads(1)


def background_executor(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose workers run torch ops single-threaded."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_one_intra_op_thread)
