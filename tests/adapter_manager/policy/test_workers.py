"""Background workers run torch ops on one intra-op thread and leave the engine's threads alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from adapter_manager import background_executor
from adapter_manager.policy.workers import PREFETCH_NICE


def test_workers_run_single_threaded_and_the_caller_keeps_its_threads():
    before = torch.get_num_threads()
    with background_executor(2, "test") as pool:
        counts = [f.result() for f in [pool.submit(torch.get_num_threads) for _ in range(4)]]
    assert counts == [1, 1, 1, 1]
    assert torch.get_num_threads() == before


def test_a_thread_initialising_later_still_gets_every_core():
    """torch.set_num_threads(1) in a worker would leave the engine thread, started later, on one thread too."""
    code = (
        "import threading, torch\n"
        "from adapter_manager import background_executor\n"
        "with background_executor(1, 'w') as pool:\n"
        "    pool.submit(lambda: torch.ones(1_000_000).clone()).result()\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))\n"
        "t.start(); t.join()\n"
        "print(seen[0], torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    engine, main = out.stdout.split()
    assert int(engine) == int(main) == torch.get_num_threads()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are a Linux feature")
def test_prefetch_workers_run_at_the_lowest_priority_and_the_caller_keeps_its_own():
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    priority = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731
    with background_executor(1, "test", PREFETCH_NICE) as pool:
        worker = pool.submit(priority).result()
    with background_executor(1, "test") as pool:  # registrations, pins: someone waits for them
        plain = pool.submit(priority).result()
    assert worker == PREFETCH_NICE == 19 and plain == own and priority() == own
