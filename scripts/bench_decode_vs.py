#!/usr/bin/env python3
"""The real engine's decode step in this checkout against another commit's, side by side (alternating processes).

Each round runs one process per checkout (this one first, then the baseline: a ``git worktree`` of the commit, given
as ``--baseline DIR``), each timing :func:`scripts.harness.engine_step_ms` (scheduler, lease, forward, sampling; 20
decode steps of ``--batch`` sequences, default 8) for base and lora_8 at each ``--context``, with the weight layout
forced the same in both (``ADAPTER_MANAGER_WEIGHT_LAYOUT``, default onednn: a baseline may have no measured choice,
``auto``). Prints each side's median step over the rounds and their ratio (and with ``--prefill`` one prompt of each
length alone, submit to first token, median of 3, without and with an adapter: the prefill path's cost); writes
out/bench_decode_vs.json. A baseline must have ``scripts.harness.engine_workload`` and ``engine_step_ms`` (the
baseline the figures use: docs/benchmarks.md).

  git worktree add /tmp/before COMMIT
  .venv/bin/python -m scripts.bench_decode_vs --baseline /tmp/before [--rounds 3] [--context 144 768]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.harness import cpu_features, write_json

_CHILD = """
import json, statistics, sys, time
import torch
try:
    from adapter_manager.runtime.engine.sampling import SamplingParams
except ImportError:  # a checkout from before the one import root
    from runtime.engine.sampling import SamplingParams
from scripts.harness import engine_step_ms, engine_workload
contexts, prefills, batches = (list(map(int, a.split(","))) if a else [] for a in sys.argv[1:4])
out = {}
with engine_workload() as w:
    for batch in batches:
        for ctx in contexts:
            for n in ("base", "lora_8"):
                tag = f"{n}@{ctx}" if batch == 8 else f"{n}@{ctx}x{batch}"
                out[tag] = engine_step_ms(w, w.mix(n, batch), ctx, 20)["step_ms"]
    gen = torch.Generator().manual_seed(2)
    for length in prefills:  # one prompt alone, submit to its first token (chunks of the engine's token budget)
        engine = w.engine(max_batch=1, max_seq_len=length + 8)
        for tag, adapter in (("prefill", None), ("prefill_lora", w.adapter_ids[0])):
            times = []
            for _ in range(3):
                prompt = torch.randint(0, w.config.vocab_size, (length,), generator=gen).tolist()
                start = time.perf_counter()
                engine.submit(prompt, adapter, SamplingParams(max_tokens=1))
                engine.run_until_idle(max_steps=1000)
                times.append(1e3 * (time.perf_counter() - start))
            out[f"{tag}@{length}"] = statistics.median(times)
print("RESULT " + json.dumps(out))
"""


def run(root: Path, contexts: list[int], prefills: list[int], batches: list[int], layout: str) -> dict[str, float]:
    """One process in checkout ``root`` (its packages first on the path); its medians (ms)."""
    env = {**os.environ, "PYTHONPATH": str(root), "ADAPTER_MANAGER_WEIGHT_LAYOUT": layout}
    cmd = [
        sys.executable,
        "-c",
        _CHILD,
        ",".join(map(str, contexts)),
        ",".join(map(str, prefills)),
        ",".join(map(str, batches)),
    ]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout (git worktree) of the other commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, nargs="*", default=[144, 768])
    parser.add_argument("--batch", type=int, nargs="*", default=[8], help="decoding sequences per step")
    parser.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths to time alone (TTFT)")
    parser.add_argument("--layout", default="onednn", help="the weight layout both sides run (blocked/onednn/plain)")
    parser.add_argument("--out", type=Path, default=Path("out/bench_decode_vs.json"))
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    sides: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for r in range(args.rounds):
        for side, root in (("this", here), ("baseline", args.baseline.resolve())):
            sides[side].append(run(root, args.context, args.prefill, args.batch, args.layout))
            print(f"round {r + 1} {side}: {json.dumps({k: round(v, 2) for k, v in sides[side][-1].items()})}")
    keys = sides["this"][0].keys()
    medians = {side: {k: statistics.median(x[k] for x in runs) for k in keys} for side, runs in sides.items()}
    ratios = {k: medians["this"][k] / medians["baseline"][k] for k in keys}
    print(f"\nmedians (ms) over {args.rounds} rounds, layout {args.layout} (decode target this / baseline <= 1.03)")
    for k in keys:
        print(f"  {k:12s} baseline {medians['baseline'][k]:7.2f}  this {medians['this'][k]:7.2f}  {ratios[k]:.3f}x")
    write_json(args.out, {"cpu": cpu_features(), "args": vars(args), "rounds": sides, "medians": medians,
                          "ratios": ratios}, default=str)  # fmt: skip


if __name__ == "__main__":
    main()
