#!/usr/bin/env python3
"""LoRA slowdown on the bench model (hidden 1024, 8 layers, intermediate 2816), same engine, rank 16.

slowdown = throughput with LoRA / base throughput - 1, where throughput = (prompt + generated tokens) / wall time
of serving a batch of requests to completion. Configurations, measured interleaved in one run (median of
--repeats): base (no LoRA stacks attached), lora_none (LoRA attached, no adapter in the batch), lora_1 (every
request on one adapter), lora_8 (8 adapters, requests spread evenly, 8 slots); the order rotates every repeat.
Targets: >= -1 %, >= -3 %, >= -5 %. lora_none runs exactly base's code path, so its deviation shows the noise.
Prints a table and writes out/bench_slowdown.json.

  .venv/bin/python -m scripts.bench_slowdown [--inputs 128,512,2048] [--output 128] [--requests 8] [--repeats 3]
      [--dtype float32|bfloat16] [--device cpu|cuda|xla] [--token-budget N]

On XLA (``--device xla``, the XLA lane's venv; a TPU with PJRT_DEVICE=TPU, the CPU device with PJRT_DEVICE=CPU) each
engine compiles every step graph first (``warm_up``), with the LoRA stacks attached and without them (base), and each
row also reports the graphs compiled while it was timed (target 0).

--heatmap: input {128, 256, 512, 1024, 2048} x output {32, 128, 512} (or --inputs / --outputs), base vs lora_8 and
lora_1 on the same engine in the same run, each cell's slowdown beside its roofline floor: the LoRA share of FLOPs
in prefill (the base's projections and causal attention per prompt token, its lm_head once per sequence:
scripts/harness/floors.py: prefill_floor) and of the weight bytes read per step in decode (distinct active adapters:
decode_floor), weighted by the time the base run spends in each phase (prefill time measured by a run with one
output token). The three configurations run on three engines (one model copy each, one manager) stepped in turn, one
step each in a fresh random order, each timed by the sum of its own steps, so the machine's drift hits all three
alike; a cell's slowdown is the median over repeats of each repeat's base / LoRA ratio. Target: slowdown <= 1.25x floor.
Writes out/bench_slowdown_heatmap.json and, with matplotlib (the `bench` extra), out/bench_slowdown_heatmap.png.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from adapter_manager.runtime.engine.engine import Engine
from adapter_manager.runtime.engine.sampling import SamplingParams
from scripts.harness import (
    CONFIGS,
    RANK,
    EngineWorkload,
    build_engine,
    decode_floor,
    engine_workload,
    prefill_floor,
    write_json,
)

TARGETS = {"lora_none": -1.0, "lora_1": -3.0, "lora_8": -5.0}


def serve(engine: Engine, prompts: list[list[int]], adapters: list[str | None], output: int) -> float:
    """Tokens per second for serving every prompt to completion."""
    params = SamplingParams(max_tokens=output)
    start = time.perf_counter()
    handles = [engine.submit(p, a, params) for p, a in zip(prompts, adapters, strict=True)]
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts) + sum(len(h.result(timeout=0)) for h in handles)
    return tokens / seconds


def random_prompts(work: EngineWorkload, length: int, count: int, gen: torch.Generator) -> list[list[int]]:
    """``count`` prompts of ``length`` uniform random tokens of the workload's vocabulary."""
    return [torch.randint(0, work.config.vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def serve_interleaved(
    engines: dict[str, Engine], prompts: list[list[int]], adapters: dict[str, list[str | None]], output: int, seed: int
) -> dict[str, float]:
    """Tokens per second of each engine serving every prompt to completion under its own mix, the engines stepped
    in turn (one step each, in a fresh random order every round) and each timed by the sum of its own steps: the
    machine's drift over seconds hits all of them alike, where serving one batch after the other it moved a cell
    by +-10 points between repeats."""
    params = SamplingParams(max_tokens=output)
    handles = {
        name: [engine.submit(p, a, params) for p, a in zip(prompts, adapters[name], strict=True)]
        for name, engine in engines.items()
    }
    busy, order = dict.fromkeys(engines, 0.0), random.Random(seed)
    while any(engine.has_work for engine in engines.values()):
        for name in order.sample(list(engines), len(engines)):
            if engines[name].has_work:
                start = time.perf_counter()
                engines[name].step()
                busy[name] += time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        name: (prompt_tokens + sum(len(h.result(timeout=0)) for h in handles[name])) / busy[name] for name in engines
    }


def heatmap(args: argparse.Namespace) -> None:
    """Every (input, output) cell: base, lora_1, lora_8 on three engines stepped in turn; slowdown vs floor."""
    inputs = [int(n) for n in args.inputs.split(",")]
    outputs = [int(n) for n in args.outputs.split(",")]
    cells = []
    with engine_workload(getattr(torch, args.dtype), args.device) as work:
        config = work.config
        names = ("base", "lora_1", "lora_8")
        # one engine per configuration, each over its own copy of the model (the KV cache lives on the model), all
        # on the workload's manager: lora_1's adapter is one of lora_8's, so the 8 slots hold both
        models = {"base": work.model, **{name: work.load_model() for name in names[1:]}}
        max_seq_len = max(inputs) + max(outputs) + 1
        engines = {
            name: build_engine(models[name], work.manager, args.requests, max_seq_len, token_budget=args.token_budget)
            for name in names
        }
        gen = torch.Generator().manual_seed(0)
        for engine in engines.values():
            serve(engine, [[1, 2, 3]] * 2, ["a0", None], 4)  # warm-up
        adapters = {name: work.mix(name, args.requests) for name in names}
        total, done = len(inputs) * len(outputs), 0
        for length in inputs:
            prompts = random_prompts(work, length, args.requests, gen)
            # one output token: (almost) only prefill; median of the repeats like every other figure
            base = engines["base"]
            prefill_tok_s = statistics.median(serve(base, prompts, adapters["base"], 1) for _ in range(args.repeats))
            prefill_s = len(prompts) * (length + 1) / prefill_tok_s
            for output in outputs:
                runs: dict[str, list[float]] = {name: [] for name in adapters}
                for repeat in range(args.repeats):
                    tok_s = serve_interleaved(engines, prompts, adapters, output, seed=repeat + 1000 * done)
                    for name, value in tok_s.items():
                        runs[name].append(value)
                med = {name: statistics.median(v) for name, v in runs.items()}
                base_s = len(prompts) * (length + output) / med["base"]
                prefill_share = min(1.0, prefill_s / base_s)
                cell = {"input": length, "output": output, "base_tok_s": round(med["base"], 1)}
                for name, k in (("lora_1", 1), ("lora_8", 8)):
                    floor = prefill_share * prefill_floor(config, RANK, length)
                    floor += (1 - prefill_share) * decode_floor(config, RANK, k)
                    # extra time per token, as a fraction of base: each repeat's own ratio (its three engines
                    # stepped in turn), the median over repeats
                    ratios = [b / v - 1 for b, v in zip(runs["base"], runs[name], strict=True)]
                    slowdown = statistics.median(ratios)
                    cell[name] = {
                        "slowdown_pct": round(100 * slowdown, 2),
                        "repeats_pct": [round(100 * r, 2) for r in ratios],
                        "floor_pct": round(100 * floor, 2),
                        "x_floor": round(slowdown / floor, 2),
                    }
                cell["prefill_share"] = round(prefill_share, 3)
                cells.append(cell)
                done += 1
                print(
                    f"[{done}/{total}] input {length:5d} output {output:4d} base {med['base']:8.1f} tok/s | "
                    + " | ".join(
                        f"{n} {cell[n]['slowdown_pct']:+6.1f} % (floor {cell[n]['floor_pct']:.1f} %, "
                        f"{cell[n]['x_floor']:.2f}x; target <= 1.25x)"
                        for n in ("lora_1", "lora_8")
                    ),
                    flush=True,
                )
    result = {"device": args.device, "dtype": args.dtype, "requests": args.requests, "repeats": args.repeats}
    result["token_budget"] = args.token_budget  # None: the engine's default
    result["cells"] = cells
    out = args.out if args.out != Path("out/bench_slowdown.json") else Path("out/bench_slowdown_heatmap.json")
    write_json(out, result)
    _plot(cells, inputs, outputs, out.with_suffix(".png"))


def _plot(cells: list[dict], inputs: list[int], outputs: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e .[bench]): no PNG")
        return
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    # one fixed scale for every run: 1.0 = the floor (green), the 1.25x target (yellow), >= 3x red
    low, target, high = 1.0, 1.25, 3.0
    cmap = LinearSegmentedColormap.from_list(
        "x_floor", [(0.0, "#1a9850"), ((target - low) / (high - low), "#fee08b"), (1.0, "#d73027")]
    )
    norm = Normalize(vmin=low, vmax=high, clip=True)
    fig, axes = plt.subplots(1, 2, figsize=(14, 6))
    for ax, name in zip(axes, ("lora_1", "lora_8"), strict=True):
        grid = [[next(c for c in cells if c["input"] == i and c["output"] == o)[name] for i in inputs] for o in outputs]
        values = [[max(cell["x_floor"], low) for cell in row] for row in grid]
        image = ax.imshow(values, cmap=cmap, norm=norm, aspect="auto")
        for y, row in enumerate(grid):
            for x, cell in enumerate(row):
                label = f"{cell['x_floor']:.2f}x floor\n{cell['slowdown_pct']:+.1f}%\n(floor {cell['floor_pct']:.1f}%)"
                ax.text(x, y, label, ha="center", va="center", fontsize=10)
        ax.set_xticks(range(len(inputs)), [str(i) for i in inputs])
        ax.set_yticks(range(len(outputs)), [str(o) for o in outputs])
        ax.set_xlabel("input tokens")
        ax.set_ylabel("output tokens")
        ax.set_title(f"{name}: slowdown vs base as x its floor")
        bar = fig.colorbar(image, ax=ax, label="x floor (1.0 = floor; fixed scale, >= 3 drawn red)")
        bar.ax.axhline(target, color="black", linewidth=2)
        bar.set_ticks([1.0, target, 1.5, 2.0, 2.5, 3.0], labels=["1.0", "1.25 target", "1.5", "2.0", "2.5", ">=3"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _compile_count() -> int:
    """Graphs torch_xla has compiled so far in this process."""
    import torch_xla.debug.metrics as metrics

    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", default=None, help="prompt lengths (default 128,512,2048; --heatmap: 128..2048)")
    parser.add_argument("--output", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:i] or xla (not with --heatmap)")
    parser.add_argument("--out", type=Path, default=Path("out/bench_slowdown.json"))
    parser.add_argument("--heatmap", action="store_true", help="the input x output grid, with floors and a PNG")
    parser.add_argument("--outputs", default="32,128,512", help="--heatmap: output lengths, comma separated")
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="tokens per engine step (default: the engine's own, 512)",
    )
    args = parser.parse_args()
    if args.heatmap and args.device == "xla":
        parser.error("--heatmap runs on cpu or cuda; on xla run the rows (without --heatmap)")
    if args.heatmap:
        args.inputs = args.inputs or "128,256,512,1024,2048"
        heatmap(args)
        return
    args.inputs = args.inputs or "128,512,2048"
    inputs = [int(n) for n in args.inputs.split(",")]
    results = {"device": args.device, "dtype": args.dtype, "requests": args.requests, "output": args.output, "rows": []}
    results["token_budget"] = args.token_budget  # None: the engine's default
    if args.device == "xla":
        import torch_xla

        device = torch_xla.device()  # registers the XLA backend's ops before anything is placed
    else:
        device = args.device
    with engine_workload(getattr(torch, args.dtype), device) as work:
        model, manager = work.model, work.manager
        gen = torch.Generator().manual_seed(0)
        for length in inputs:
            engine = work.engine(args.requests, length + args.output + 1, token_budget=args.token_budget)
            prompts = random_prompts(work, length, args.requests, gen)
            adapters = {name: work.mix(name, args.requests) for name in CONFIGS}
            serve(engine, prompts[:2], ["a0", None], 4)  # warm-up: loads, allocator, kernels
            if args.device == "xla":  # every step graph, with the stacks and without (base), before any timing
                engine.warm_up()
                model.detach_lora()
                engine.warm_up()
                model.attach_lora(manager.stacks)
            compiles = _compile_count() if args.device == "xla" else None
            throughput: dict[str, list[float]] = {c: [] for c in CONFIGS}
            for repeat in range(args.repeats):
                for name in CONFIGS[repeat % 4 :] + CONFIGS[: repeat % 4]:  # rotated: no config always runs first
                    if name == "base":
                        model.detach_lora()
                    else:
                        model.attach_lora(manager.stacks)
                    throughput[name].append(serve(engine, prompts, adapters[name], args.output))
            model.attach_lora(manager.stacks)
            med = {name: statistics.median(v) for name, v in throughput.items()}
            row = {"input": length, **{f"{n}_tok_s": round(v, 1) for n, v in med.items()}}
            row["spread_pct"] = {
                n: round(100 * (max(v) - min(v)) / statistics.median(v), 1) for n, v in throughput.items()
            }
            if compiles is not None:
                row["compiles_after_warm_up"] = _compile_count() - compiles
            for name in TARGETS:
                row[f"{name}_slowdown_pct"] = round(100 * (med[name] / med["base"] - 1), 2)
            results["rows"].append(row)
            print(
                f"input {length:5d} output {args.output}: base {med['base']:8.1f} tok/s | "
                + " | ".join(
                    f"{n} {row[f'{n}_slowdown_pct']:+6.2f} % (target >= {t:+.0f} %)" for n, t in TARGETS.items()
                )
                + f" | max spread over repeats {max(row['spread_pct'].values()):.1f} %"
                + ("" if compiles is None else f" | compiles after warm-up {row['compiles_after_warm_up']} (target 0)"),
                flush=True,
            )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
