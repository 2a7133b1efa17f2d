"""Tensor parallelism on CPU, one process per shard (gloo on loopback): the engine trace of ``_tp_trace`` runs in a
process of its own as rank 0, which starts the other shards; each loads only its part of every weight and holds its
section of the adapter pool in shared memory, which rank 0 writes each slot load into; rank 0 sends each step.

TP = 2 (KV heads split) and 4 (KV heads replicated: the tiny Llama has 2) with mixed adapters, swaps (5 adapters
through 2 slots), prefix hits and preemptions, then echo requests, must equal TP = 1, i.e. PEFT: every greedy
generation HF's tokens, every prompt logprob within 1e-4 of PEFT's; and the collectives are Megatron's: per forward 2
all-reduces a layer, the embedding's, and the logits' all-gather."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.engine._tp_oracle import check_against_peft, trace

pytest.importorskip("peft")


@pytest.mark.parametrize(("tp", "full"), [(2, False), (4, False), (2, True)])
def test_shard_processes_equal_peft(written, expected, tmp_path, tp, full):
    """``full``: fully sharded LoRA, each process's shrinks summed over the group (4 more all-reduces a layer on the
    steps with an adapter, so only the default's count is a whole multiple of a forward's)."""
    result = trace(written, expected, tmp_path, tp, "cpu", full)
    check_against_peft(result, written, expected)
    layers = 3  # the tiny Llama's
    forwards = result["collectives"] / (2 * layers + 2)
    assert forwards > 50 and (full or forwards == int(forwards)), result["collectives"]


_RANK0 = """
import sys, time
from pathlib import Path
from adapter_manager import TensorParallel
from adapter_manager.runtime.engine.shard_workers import ShardLaunch, start_shard_workers
workers = start_shard_workers(ShardLaunch(Path(sys.argv[1]), TensorParallel(2)))
workers.load_model()
print(*[p.pid for p in workers.processes], flush=True)
time.sleep(600)
"""


def test_shards_exit_when_rank_0_is_killed_outright(written, tmp_path):
    """SIGKILL sends no stop message (an OOM kill, a cluster replica torn down): the shards must still exit, not wait
    days for their next step holding their weights (their gloo connections to rank 0 break)."""
    folder = written[None][0]
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        shards = [int(pid) for pid in rank0.stdout.readline().split()]  # once every shard has loaded its part
        assert shards and all(_alive(pid) for pid in shards)
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in shards) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in shards), shards
    finally:
        rank0.kill()


_ENGINE = """
import sys
from pathlib import Path
from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, TensorParallel
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.shard_workers import ShardLaunch, start_shard_workers
workers = start_shard_workers(ShardLaunch(Path(sys.argv[1]), TensorParallel(2)))
model = workers.load_model()
rows = RowOptions(max_rank=8, tensor_parallel=TensorParallel(2))
config = AdapterManagerConfig(max_slots=2, rows=rows, prefetch_workers=0)
manager = AdapterManager(model.config.to_spec("tiny"), config)
manager.register(sys.argv[2], adapter_id="a")
Engine(model, manager, EngineConfig(max_batch=2, max_seq_len=32))
manager.release(manager.acquire(["a"]))
print(*[p.pid for p in workers.processes], flush=True)
sys.stdin.readline()
manager.close()
workers.close()
"""


def test_every_shard_maps_the_one_pool_and_no_file_is_left(written):
    """The pool's rows are one memfd that rank 0 writes each slot load into and every shard maps (the same inode in
    every process: one copy, no section copied per shard); being a memfd, it is never a file in /dev/shm, while the
    processes run or after they stop."""
    command = [sys.executable, "-c", _ENGINE, str(written[None][0]), str(written["qv"][0])]
    before = set(Path("/dev/shm").iterdir())
    rank0 = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        shards = [int(pid) for pid in rank0.stdout.readline().split()]
        assert shards and all(_alive(pid) for pid in shards)
        inodes = set()
        for pid in (rank0.pid, *shards):
            with open(f"/proc/{pid}/maps") as maps:
                mapped = [line.split() for line in maps if "/memfd:adapter-manager-rows" in line]
            assert mapped, pid
            inodes |= {fields[4] for fields in mapped}
        assert len(inodes) == 1, inodes
        assert set(Path("/dev/shm").iterdir()) <= before
        rank0.communicate("stop\n", timeout=60)
        assert rank0.returncode == 0 and not any(_alive(pid) for pid in shards)
    finally:
        rank0.kill()
    assert set(Path("/dev/shm").iterdir()) <= before


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
