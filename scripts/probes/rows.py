#!/usr/bin/env python3
"""Where one adapter's decode LoRA cost goes: per projection, against the bytes it reads, and whether the rows stay
in cache between steps.

The bench model (fp32, packed: ``lora_blocked``) decoding ``--seqs`` sequences at context ``--context``, in one
process, every closure in a fresh random order each repeat (``--rounds`` rounds of ``--repeats``):
- base, lora_1, lora_8, and lora_1 with its rows touched (each linear first reads the step's active rows into cache,
  outside its timer: what a perfect prefetch would give the kernel; its step time includes the touching, so only
  its per-call times are read);
- lora_1 / lora_8 on a second copy of the model attached to a module-major copy of the same rows (one adapter's A rows
  of a fused linear one contiguous stream, every Bt contiguous) instead of the pool's row layout, where one adapter's
  rows of a projection are ``rank`` runs of 1–11 KB a row's width apart;
- each projection's time (a timer around ``LoRALinear.output``) and its increment over base, beside its floor: the
  active rows' bytes at the rate that projection streams its base weight in the base step;
- a buffer of one adapter's bytes read cold (after a 256 MB write), hot (read twice in a row) and after one base step:
  whether the step's weight stream leaves the rows in the last-level cache for the next step.

Writes out/bench_rows.json.

  .venv/bin/python -m scripts.probes.rows [--rounds 3] [--repeats 40] [--seqs 8] [--context 144]
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from adapter_manager.runtime.model.projection import LoRALinear
from scripts.harness import StepSetup, adapter_bytes, decode_step_parser, engine_workload, write_json

FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""The projections one LoRALinear holds, in the pool's column order."""


class RowCopy(NamedTuple):
    """A module's rows outside the pool (``attach`` reads ``a`` [N, in] and ``bt`` [N, out])."""

    a: torch.Tensor
    bt: torch.Tensor


def module_major(stacks: dict) -> dict:
    """The same rows, each fused linear's A as one contiguous [N, P, in] tensor and every Bt contiguous."""
    copies = {}
    for layer in sorted({key.layer for key in stacks}):
        keys = {key.proj: key for key in stacks if key.layer == layer}
        for group in FUSED:
            a = torch.stack([stacks[keys[p]].a for p in group], dim=1).contiguous()  # [N, P, in]
            for index, proj in enumerate(group):
                copies[keys[proj]] = RowCopy(a[:, index], stacks[keys[proj]].bt.contiguous())
    return copies


class Timers:
    """Per LoRALinear (by name) the seconds its ``output`` took in the current step; optionally touching the step's
    active rows before each call."""

    def __init__(self, names: dict[LoRALinear, str]) -> None:
        self.names = names
        self.step: dict[str, float] = {}
        self.touch = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        original = LoRALinear.output
        timers = self

        def output(layer: LoRALinear, x: torch.Tensor, meta=None, kernel: bool = False) -> torch.Tensor:  # noqa: ANN001
            if timers.touch and meta is not None and meta.runs is not None:
                for _, _, first, rank in meta.runs.tolist():
                    for group in layer._groups:  # noqa: SLF001 - bench: the layer's pool views
                        group.a_parts[first : first + rank].sum()
                        for bt in group.bt_parts:
                            bt[first : first + rank].sum()
            start = time.perf_counter()
            y = original(layer, x, meta, kernel)
            name = timers.names.get(layer)
            if name is not None:
                timers.step[name] = timers.step.get(name, 0.0) + time.perf_counter() - start
            return y

        LoRALinear.output = output
        try:
            yield
        finally:
            LoRALinear.output = original


def layer_bytes(layer: LoRALinear, adapters: int, rank: int) -> tuple[int, int]:
    """(base weight bytes, the rows of ``adapters`` rank-``rank`` adapters) of one LoRALinear, fp32."""
    weight = layer.in_features * layer.out_total * 4
    return weight, adapters * rank * (len(layer.out_features) * layer.in_features + layer.out_total) * 4


def cache_residency(nbytes: int, step: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median µs to read ``nbytes`` cold, hot, and after one ``step``."""
    buf = torch.randn(nbytes // 4)
    flush = torch.empty(256 << 20, dtype=torch.uint8)

    def read() -> float:
        start = time.perf_counter()
        buf.sum()
        return 1e6 * (time.perf_counter() - start)

    times = defaultdict(list)
    for _ in range(repeats):
        flush.fill_(1)
        times["cold"].append(read())
        times["hot"].append(read())
        step()
        times["after_step"].append(read())
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    parser = decode_step_parser(__doc__, "out/bench_rows.json", repeats=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    with engine_workload() as work:
        pool_model = work.load_model(pack_weights=True)
        copy_model = work.load_model(pack_weights=True)
        pool = StepSetup(work, pool_model, args.seqs, args.context, args.seqs)
        copy = StepSetup(work, copy_model, args.seqs, args.context, args.seqs)
        copy_model.detach_lora()
        copy_model.attach_lora(module_major(dict(work.manager.stacks)))  # after the leases loaded the rows
        linears = {m: n for n, m in pool_model.named_modules() if isinstance(m, LoRALinear) and m.has_lora}
        copies = {m: n for n, m in copy_model.named_modules() if isinstance(m, LoRALinear) and m.has_lora}
        kinds = {n: n.rsplit(".", 1)[-1] for n in linears.values()}
        timers = Timers(linears | copies)
        closures = {
            "base": pool.step_fn("base", None),
            "lora_1": pool.step_fn("lora_1", None),
            "lora_1/touched": pool.step_fn("lora_1", None),
            "lora_8": pool.step_fn("lora_8", None),
            "base/module_major": copy.step_fn("base", None),  # the second model's own base: its weights are a copy
            "lora_1/module_major": copy.step_fn("lora_1", None),
            "lora_8/module_major": copy.step_fn("lora_8", None),
        }
        rounds = []
        with timers.installed():
            for index in range(args.rounds):
                steps, per_linear = defaultdict(list), defaultdict(lambda: defaultdict(list))
                for fn in closures.values():
                    fn()
                order = random.Random(index)
                for _ in range(args.repeats):
                    for key in order.sample(list(closures), len(closures)):
                        timers.touch, timers.step = key.endswith("touched"), {}
                        start = time.perf_counter()
                        closures[key]()
                        steps[key].append(time.perf_counter() - start)
                        for name, seconds in timers.step.items():
                            per_linear[key][kinds[name]].append(seconds)
                row = {"base_ms": 1e3 * statistics.median(steps["base"])}
                for key in closures:
                    if not key.startswith("base"):
                        base = statistics.median(steps["base/module_major" if "module_major" in key else "base"])
                        row[f"{key}_pct"] = 100 * (statistics.median(steps[key]) / base - 1)
                second_base_ms = 1e3 * statistics.median(steps["base/module_major"])
                row["base/module_major_pct"] = 100 * (second_base_ms / row["base_ms"] - 1)
                # per projection kind, µs per call (medians over calls of every layer)
                row["per_call_us"] = {
                    key: {kind: 1e6 * statistics.median(v) for kind, v in kinds_.items()}
                    for key, kinds_ in per_linear.items()
                }
                rounds.append(row)
                print(
                    f"round {index + 1}: base {row['base_ms']:.2f} ms | "
                    + " | ".join(f"{k} {row[f'{k}_pct']:+.2f} %" for k in closures if k != "base"),
                    flush=True,
                )
        residency = cache_residency(adapter_bytes(work.config, 1, 4), closures["base"], args.repeats)
        pool.close()
        copy.close()
    one = {kinds[n]: layer_bytes(m, 1, 16) for m, n in linears.items()}
    print(f"\nper call, µs (medians of {args.rounds} rounds' medians); floor = the rows' bytes at the base call's rate")
    print("projection   base    lora_1 (+)         touched (+)        module-major (+)   floor   lora_8 (+)")
    print("(module-major: over the second model's own base)")
    summary = {}
    for kind, (weight, rows) in one.items():
        med = {k: statistics.median(r["per_call_us"][k][kind] for r in rounds) for k in closures}
        floor = med["base"] * rows / weight
        summary[kind] = {**med, "floor_lora_1": floor}
        of = {k: med["base/module_major" if "module_major" in k else "base"] for k in closures}
        print(
            f"{kind:10s} {med['base']:7.1f}   "
            + "   ".join(
                f"{med[k]:7.1f} ({med[k] - of[k]:+5.1f})" for k in ("lora_1", "lora_1/touched", "lora_1/module_major")
            )
            + f"   {floor:5.1f}   {med['lora_8']:7.1f} ({med['lora_8'] - med['base']:+5.1f})"
        )
    print(
        f"one adapter's bytes ({adapter_bytes(work.config, 1, 4) / 1e6:.1f} MB) read cold {residency['cold']:.0f} µs, "
        f"hot {residency['hot']:.0f} µs, after one base step {residency['after_step']:.0f} µs"
    )
    write_json(args.out, {"rounds": rounds, "per_call": summary, "residency_us": residency})


if __name__ == "__main__":
    main()
