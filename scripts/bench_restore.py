#!/usr/bin/env python3
"""A restart with --adapters (1000) durable registrations: how long until the manager serves, against the 5 s target.

Set-up (reused by later runs of the same size): --adapters synthetic rank --rank adapters on the bench base (all
seven projections, `scripts.harness.write_adapters`) served by the local hub, registered by hub id through one manager
with a --state-dir and a disk bound, so the HF cache and the sqlite3 state hold them all. Then the hub goes away and
a fresh process restarts on that state (offline), timing: serving (AdapterManager constructed, restore() returned:
requests can be submitted), how many adapters were prepared by then, the first request of one adapter (prepared on
first use), and preparing every adapter in turn afterwards: restore + that is the sequential restore that prepared
everything before serving. --baseline DIR times the same restart with DIR's adapter_manager first on the path (e.g.
`git archive HEAD adapter_manager | tar -x -C /tmp/head`), side by side. Writes out/bench_restore.json.

  .venv/bin/python -m scripts.bench_restore                        # 1000 registrations
  .venv/bin/python -m scripts.bench_restore --baseline /tmp/head   # and DIR's restart beside it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import adapter_manager
from adapter_manager import (
    AdapterManager,
    AdapterManagerConfig,
    BaseModelSpec,
    HubConfig,
    LocalHub,
    RowOptions,
    StateStore,
)

TARGET_S = 5.0
_GIB = 1 << 30


def manager_config(work: Path, rank: int, hub: HubConfig) -> AdapterManagerConfig:
    """The manager of both runs: a 64 GiB disk bound (the disk tier on, nothing evicted), no prefetch workers."""
    return AdapterManagerConfig(
        max_slots=8,
        rows=RowOptions(max_rank=rank),
        host_cache_bytes=_GIB,
        prefetch_workers=0,
        hub=hub,
        state_dir=work / "state",
        disk_cache_bytes=64 * _GIB,
    )


def set_up(work: Path, count: int, rank: int) -> float:
    """Register `count` hub adapters into work/state and work/cache unless a run of this size left them; seconds."""
    from scripts.harness import write_adapters  # here: the --restart child imports no more of this tree than needed

    ids = [f"a{i:04d}" for i in range(count)]
    if (work / "state").exists() and len(StateStore(work / "state").load()) == count:
        return 0.0
    shutil.rmtree(work / "state", ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    spec = BaseModelSpec.bench()
    start = time.perf_counter()
    write_adapters(work / "hub" / "bench", spec, ids, [rank] * count, reuse=True)
    with LocalHub(work / "hub") as hub:
        hub_config = HubConfig(endpoint=hub.endpoint, cache_dir=work / "cache", retries=0, progress_bars=False)
        with AdapterManager(spec, manager_config(work, rank, hub_config)) as manager:
            for adapter_id in ids:
                manager.register(f"bench/{adapter_id}", adapter_id)
    return time.perf_counter() - start


def restart(work: Path, rank: int) -> dict[str, float]:
    """One restart in this process (the hub gone, offline): the figures `main` prints."""
    spec = BaseModelSpec.bench()
    config = manager_config(work, rank, HubConfig(cache_dir=work / "cache", offline=True, progress_bars=False))
    start = time.perf_counter()
    manager = AdapterManager(spec, config)
    serving_s = time.perf_counter() - start
    moves = manager.metrics().moves
    prepared = moves["disk_to_host"].count if "disk_to_host" in moves else 0
    ids = sorted(manager.restored)
    start = time.perf_counter()
    manager.release(manager.acquire([ids[0]]))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    for adapter_id in ids:
        manager.registry.prepared(adapter_id)
    prepare_all_s = time.perf_counter() - start
    unrestored = len(manager.registry.unrestored())
    manager.close()
    return dict(
        code=str(Path(adapter_manager.__file__).parent),
        serving_s=serving_s,
        restored=len(ids),
        unrestored=unrestored,
        prepared_at_serving=prepared,
        first_request_s=first_s,
        prepare_all_s=prepare_all_s,
    )


def timed_restart(work: Path, rank: int, code: Path | None) -> dict[str, float]:
    """`restart` in a fresh process (a real restart: nothing warm but the page cache); `code` first on the path.

    The child runs this file by its path, not with ``-m``: ``-m`` would put the working directory (this tree) on the
    path before PYTHONPATH, ahead of `code`."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code.resolve()), env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--restart", str(work), "--rank", str(rank)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"restart failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("out/bench_restore"), help="hub, HF cache, state (reused)")
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier tree to time beside this one")
    parser.add_argument("--out", type=Path, default=Path("out/bench_restore.json"))
    parser.add_argument("--restart", type=Path, default=None, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args()
    if args.restart is not None:
        print(json.dumps(restart(args.restart, args.rank)))
        return
    setup_s = set_up(args.work, args.adapters, args.rank)
    runs = {"this tree": timed_restart(args.work, args.rank, None)}
    if args.baseline is not None:
        runs[f"baseline {args.baseline}"] = timed_restart(args.work, args.rank, args.baseline)
    print(
        f"restart with {args.adapters} registrations (rank {args.rank}, all 7 projections, bench base), hub down"
        + (f"; set-up {setup_s:.0f}s" if setup_s else "; set-up reused")
    )
    print(f"{'':28} {'serving':>9} {'target':>7} {'prepared':>9} {'first req':>10} {'+ prepare all':>14}")
    for name, r in runs.items():
        verdict = "ok" if r["serving_s"] <= TARGET_S else "MISSED"
        print(
            f"{name:28} {r['serving_s']:8.2f}s {'<=' + format(TARGET_S, '.0f') + 's':>7} "
            f"{r['prepared_at_serving']:>9} {r['first_request_s'] * 1e3:8.1f}ms {r['prepare_all_s']:13.2f}s  "
            f"{verdict} ({r['restored']} restored, {r['unrestored']} unrestored; {r['code']})"
        )
    print("serving + prepare all = the sequential restore that prepared every adapter before serving")
    from scripts.harness import write_json  # here, as in set_up: the --restart child imports none of the harness

    results = dict(adapters=args.adapters, rank=args.rank, target_s=TARGET_S, setup_s=setup_s, runs=runs)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
