#!/usr/bin/env python3
"""One call per packed decode linear against two: what the Python layers and a dispatch per linear cost in the step.

The bench model's packed decode step (fp32, ``--seqs`` sequences at context ``--context``) on the cpu backend's FUSED
form, two ways in the same process: every LoRA linear as one ``lora_blocked`` call (our blocked layout's matmul and
each group's LoRA inside one C++ op: the default; ``lora_onednn`` with ``ADAPTER_MANAGER_WEIGHT_LAYOUT=onednn``), and
as the packed matmul, then ``apply_parts`` per group through the backend (``LoRALinear.one_call = False``: the path
before it; the same values). Closures for base, lora_1 and lora_8 both
ways and a read pass over 512 MB (so no step finds the last one's rows in cache) run in a fresh random order every
repeat; each round prints medians, LoRA cost = step / base − 1 beside its floor (the active adapters' bytes ÷ the
base's, shared/DESIGN.md, Floors). Writes out/bench_call.json.

  .venv/bin/python -m scripts.probes.call [--rounds 3] [--repeats 40] [--seqs 8] [--context 144]
"""

from __future__ import annotations

import statistics

import torch

from adapter_manager.runtime.model.projection import LoRALinear
from scripts.harness import (
    StepSetup,
    adapter_bytes,
    base_linears,
    decode_step_parser,
    engine_workload,
    interleaved_ms,
    write_json,
)


def main() -> None:
    parser = decode_step_parser(__doc__, "out/bench_call.json", repeats=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    rounds = []
    with engine_workload(pack_weights=True) as work:
        setup = StepSetup(work, work.model, args.seqs, args.context, args.seqs)
        layers = [m for m in work.model.modules() if isinstance(m, LoRALinear) and m.has_lora]
        base_bytes = sum(
            linear.weight_dtype.itemsize * linear.in_features * sum(linear.out_features)
            for linear in base_linears(work.model)
        )
        floors = {cfg: adapter_bytes(work.config, n, 4) / base_bytes for cfg, n in (("lora_1", 1), ("lora_8", 8))}

        def way(one_call: bool, step):  # noqa: ANN001, ANN202
            def run():  # noqa: ANN202
                for linear in layers:
                    linear.one_call = one_call
                return step()

            return run

        fns = {"base": way(True, setup.step_fn("base", None))}
        for cfg in floors:
            step = setup.step_fn(cfg, None)
            fns[f"one_call/{cfg}"], fns[f"two_calls/{cfg}"] = way(True, step), way(False, step)
        flush = torch.ones(128 << 20)
        fns["read_pass"] = lambda: flush.sum()
        for index in range(args.rounds):
            ms = interleaved_ms(fns, args.repeats)
            costs = {key: ms[key] / ms["base"] - 1 for key in ms if "/" in key}
            rounds.append({"ms": ms, "cost": costs})
            line = "  ".join(f"{key} {100 * c:+.1f} %" for key, c in costs.items())
            print(f"round {index + 1}: base {ms['base']:.2f} ms  {line}", flush=True)
        for linear in layers:
            linear.one_call = True
        setup.close()
    print("\nmedian over rounds (LoRA cost over base, floor, x floor):")
    summary = {}
    for cfg, floor in floors.items():
        for mode in ("one_call", "two_calls"):
            cost = statistics.median(r["cost"][f"{mode}/{cfg}"] for r in rounds)
            summary[f"{mode}/{cfg}"] = cost
            print(f"  {cfg:7s} {mode:9s} {100 * cost:+6.2f} %   floor {100 * floor:5.2f} %   {cost / floor:5.2f}x")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "floors": floors, "rounds": rounds}
    write_json(args.out, {**record, "median_cost": summary})


if __name__ == "__main__":
    main()
