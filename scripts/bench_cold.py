"""Cold arrivals beside decoding requests: does anyone else pay for a cold adapter?

The bench model (fp32, CPU) decodes 8 requests on 8 resident rank-16 adapters; meanwhile 8 requests for rank-64
adapters arrive, one every 2 steps. Their adapters are registered (local PEFT folders: on disk) but
- ``cold``: not prepared in the host tier (prefetching on: they are prepared on the workers),
- ``host``: already prepared in the host tier (the reference: only host -> slot copies are left),
- ``cold_sync``: not prepared, prefetching off (the engine prepares them inside its step).
Each variant runs ``--repeats`` times, interleaved in a seeded random order; medians are reported. Figures: the 8
decoding requests' time in all (first step to last token) and the largest single step, each as a ratio of the
``host`` run's (targets: <= 1.02x in all, no step above 1.25x the host run's largest), and the engine's stall.

    .venv/bin/python -m scripts.bench_cold [--repeats 5] [--out out/bench_cold.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import build_engine, write_adapters, write_checkpoint, write_json

WARM, COLD = 8, 8
WARM_RANK, COLD_RANK = 16, 64
VARIANTS = ("cold", "host", "cold_sync")


def run(model, spec, folders: dict[str, Path], variant: str, args: argparse.Namespace) -> dict:
    config = AdapterManagerConfig(
        max_slots=WARM + COLD,
        rows=RowOptions(max_rank=COLD_RANK),
        host_cache_bytes=(WARM + COLD) * spec.max_adapter_bytes(COLD_RANK, 4),
        prefetch_workers=0 if variant == "cold_sync" else 2,
        prefetch_popular=0,
    )
    with AdapterManager(spec, config) as manager:
        for adapter_id, folder in folders.items():
            manager.register(str(folder), adapter_id=adapter_id)
        warm = [a for a in folders if a.startswith("w")]
        cold = [a for a in folders if a.startswith("c")]
        if variant != "host":
            for adapter_id in cold:  # on disk, not prepared: registration left them in the host tier
                manager.registry.host.discard((adapter_id, manager.registry.get(adapter_id).sha))
        engine = build_engine(model, manager, max_batch=WARM + COLD, max_seq_len=256)
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        generator = torch.Generator().manual_seed(0)
        prompt = lambda: torch.randint(1, model.config.vocab_size, (args.prompt,), generator=generator).tolist()  # noqa: E731
        manager.release(manager.acquire(warm))  # the decoding requests' adapters are resident
        handles = [engine.submit(prompt(), a, params) for a in warm]
        engine.step()  # their prefill
        steps, arrivals, start = [], list(cold), time.perf_counter()
        stall_before = _stall_total(manager)
        while not all(h.done for h in handles):
            if arrivals and len(steps) % 2 == 0:
                engine.submit(prompt(), arrivals.pop(0), SamplingParams(max_tokens=4, ignore_eos=True))
            begin = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - begin)
        decode_s = time.perf_counter() - start
        stall_s = _stall_total(manager) - stall_before
        engine.run_until_idle()
        moves = manager.metrics().moves
        prepare = moves.get("disk_to_host")
    return {
        "variant": variant,
        "decode_s": decode_s,
        "steps": len(steps),
        "max_step_s": max(steps),
        "median_step_s": statistics.median(steps),
        "stall_s": stall_s,
        "preparations": prepare.count if prepare else 0,
        "prepare_p50_s": prepare.p50_s if prepare else None,
    }


def _stall_total(manager: AdapterManager) -> float:
    stall = manager.metrics().stall
    return stall.total_seconds if stall else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (interleaved)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens of every request")
    parser.add_argument("--tokens", type=int, default=48, help="tokens the 8 decoding requests generate")
    parser.add_argument("--out", type=Path, default=Path("out/bench_cold.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    llama = LlamaConfig.bench()
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        root = Path(tmp)
        spec = llama.to_spec("bench")
        model = load_model(write_checkpoint(root / "model", llama), dtype=torch.float32)
        ids = [f"w{i}" for i in range(WARM)] + [f"c{i}" for i in range(COLD)]
        ranks = [WARM_RANK] * WARM + [COLD_RANK] * COLD
        folders = dict(zip(ids, write_adapters(root / "adapters", spec, ids, ranks), strict=True))
        order = [v for v in VARIANTS for _ in range(args.repeats)]
        random.Random(0).shuffle(order)
        run(model, spec, folders, "host", args)  # warm-up: oneDNN, allocator, page cache
        rows = [run(model, spec, folders, variant, args) for variant in order]
    medians = {}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        medians[variant] = {k: statistics.median(r[k] for r in mine) for k in ("decode_s", "max_step_s", "stall_s")}
        medians[variant]["preparations"] = statistics.median(r["preparations"] for r in mine)
    reference = medians["host"]
    print(f"8 decoding requests (rank {WARM_RANK}) + 8 arrivals on rank-{COLD_RANK} adapters, one per 2 steps; "
          f"medians of {args.repeats}; reference: the host run (adapters prepared)")  # fmt: skip
    print(f"{'variant':11} {'decode s':>9} {'x host':>7} {'max step ms':>12} {'x host max':>11} {'stall ms':>9}")
    for variant in VARIANTS:
        m = medians[variant]
        print(
            f"{variant:11} {m['decode_s']:9.3f} {m['decode_s'] / reference['decode_s']:7.3f} "
            f"{m['max_step_s'] * 1e3:12.1f} {m['max_step_s'] / reference['max_step_s']:11.3f} {m['stall_s'] * 1e3:9.1f}"
        )
    print("targets (cold): <= 1.02x in all, max step <= 1.25x the host run's; stall 0")
    write_json(args.out, {"rows": rows, "medians": medians})


if __name__ == "__main__":
    main()
