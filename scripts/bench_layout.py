#!/usr/bin/env python3
"""Our blocked weight layout against oneDNN's: the bench model's packed decode step, base and LoRA, in one process.

Two copies of the bench model (fp32), one packed in our blocked layout (``lora_blocked``: the default) and one in
oneDNN's (``ADAPTER_MANAGER_WEIGHT_LAYOUT=onednn``: ``lora_onednn``), each decoding ``--seqs`` sequences at context
``--context`` on the cpu backend's FUSED form for base, LoRA attached with no adapter, 1 adapter and 8 distinct rank-16
adapters; beside them each layout's weight-matmul chain alone (every base weight of the step once, M = seqs) and a read
pass over the weights' bytes (the memory floor; it also flushes the caches between closures). Every closure runs in a
fresh random order each repeat; each round prints medians and LoRA cost = step / the same layout's base − 1 beside
its floor (the active adapters' bytes ÷ the base's: shared/DESIGN.md, Floors), and base step / chain. "split" is the
blocked model with the matmul and the LoRA in separate calls (``LoRALinear.one_call = False``: ``apply_parts`` per
group at decode, the torch forms at prefill), its cost over the blocked base. With ``--prefill N`` the same for a
prefill of N tokens over the sequences (floor: LoRA FLOPs ÷ base FLOPs): there ``lora_blocked`` applies each long
run's LoRA inside its GEMM, where "split" and oneDNN's layout take the torch forms.
Writes out/bench_layout.json.

  .venv/bin/python -m scripts.bench_layout [--rounds 3] [--repeats 30] [--seqs 8] [--context 144]
      [--prefill 0]
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from collections.abc import Callable

import torch

from adapter_manager import kernels
from adapter_manager.kernels import WeightLayout
from adapter_manager.kernels.cpu import weights as packing
from scripts.harness import (
    CONFIGS,
    RANK,
    StepSetup,
    adapter_bytes,
    base_linears,
    cpu_model,
    decode_step_parser,
    engine_workload,
    interleaved_ms,
    prefill_floor,
    write_json,
)

LAYOUTS = ("blocked", "onednn")
VARIANTS = (*LAYOUTS, "split")
"""split: the blocked layout's layers with ``one_call = False``: the blocked matmul, then the step's own LoRA form
(``apply_parts`` per group at decode, the torch forms at prefill), against the blocked base."""
BASE_OF = {"blocked": "blocked", "onednn": "onednn", "split": "blocked"}


def one_call(model: torch.nn.Module, value: bool, step: Callable[[], object]) -> Callable[[], object]:
    """``step`` with every LoRALinear's ``one_call`` set to ``value`` first (two variants share one model)."""
    layers = base_linears(model)

    def run() -> object:
        for layer in layers:
            layer.one_call = value
        return step()

    return run


def main() -> None:
    parser = decode_step_parser(__doc__, "out/bench_layout.json", repeats=30)
    parser.add_argument("--prefill", type=int, default=0, help="prefill tokens over the sequences (0: decode)")
    args = parser.parse_args()
    torch.manual_seed(0)
    prefill = args.prefill or None
    rounds = []
    with engine_workload(pack_weights=False) as work:
        plain = work.model
        weights = [m.weight.detach() for m in base_linears(plain)]
        base_bytes = sum(w.numel() * w.element_size() for w in weights)
        if prefill:
            floors = dict.fromkeys(("lora_1", "lora_8"), prefill_floor(work.config, RANK, prefill // args.seqs))
        else:
            floors = {c: adapter_bytes(work.config, n, 4) / base_bytes for c, n in (("lora_1", 1), ("lora_8", 8))}
        fns, setups = {}, []
        for layout in LAYOUTS:
            os.environ[packing.LAYOUT_ENV] = layout
            model = work.load_model(pack_weights=True)
            kinds = {m.layout is WeightLayout.BLOCKED for m in base_linears(model)}
            assert kinds == {layout == "blocked"}, (layout, kinds)
            setup = StepSetup(work, model, args.seqs, args.context, max(args.seqs, args.prefill))
            setups.append(setup)
            for cfg in CONFIGS:
                fns[f"{layout}/{cfg}"] = one_call(model, True, setup.step_fn(cfg, prefill))
                if layout == "blocked" and cfg != "base":  # the same layers, the matmul and the LoRA in two calls
                    fns[f"split/{cfg}"] = one_call(model, False, setup.step_fn(cfg, prefill))
        os.environ.pop(packing.LAYOUT_ENV)
        shapes = Counter(tuple(w.shape) for w in weights)
        chosen = kernels.choose_weight_layout(torch.float32, [(o, i, n) for (o, i), n in shapes.items()], "cpu")
        print(f"CPU {cpu_model()}; the engine's measured choice: {chosen.describe()}", flush=True)
        if not prefill:
            inputs = {w.shape[1]: torch.randn(args.seqs, w.shape[1]) for w in weights}
            onednn = [packing.onednn_pack(w) for w in weights]
            blocked = [packing.pack_weight(w) for w in weights]
            fns["chain/onednn"] = lambda: [
                packing.onednn_linear(inputs[w.shape[1]], p) for w, p in zip(weights, onednn, strict=True)
            ]
            fns["chain/blocked"] = lambda: [
                packing.packed_linear(inputs[w.shape[1]], b, w.shape[0]) for w, b in zip(weights, blocked, strict=True)
            ]
        flat = torch.cat([w.reshape(-1) for w in weights])
        fns["read_pass"] = lambda: flat.sum()
        for index in range(args.rounds):
            ms = interleaved_ms(fns, args.repeats)
            cost = {
                f"{layout}/{cfg}": ms[f"{layout}/{cfg}"] / ms[f"{BASE_OF[layout]}/base"] - 1
                for layout in VARIANTS
                for cfg in CONFIGS[1:]
            }
            rounds.append({"ms": ms, "cost": cost})
            line = "  ".join(f"{k} {100 * c:+.1f} %" for k, c in cost.items())
            bases = "  ".join(f"{layout} {ms[f'{layout}/base']:.2f}" for layout in LAYOUTS)
            print(f"round {index + 1}: base ms {bases}  read {ms['read_pass']:.2f}  {line}", flush=True)
        for setup in setups:
            setup.close()
    summary: dict[str, float] = {}
    med = lambda key: statistics.median(r["ms"][key] for r in rounds)  # noqa: E731
    print(f"\nmedians over {args.rounds} rounds ({'prefill ' + str(prefill) if prefill else 'decode'}, ms):")
    print(f"  read pass {med('read_pass'):.2f} ({base_bytes / med('read_pass') / 1e6:.1f} GB/s)")
    for layout in LAYOUTS:
        base = med(f"{layout}/base")
        summary[f"{layout}/base_ms"] = base
        chain = ""
        if not prefill:
            ref = med(f"chain/{layout}")
            chain = f"  chain {ref:.2f}  base / chain {base / ref:.2f}x"
        print(f"  {layout:8s} base {base:.2f}{chain}")
    for layout in VARIANTS:
        for cfg in CONFIGS[1:]:
            cost = statistics.median(r["cost"][f"{layout}/{cfg}"] for r in rounds)
            summary[f"{layout}/{cfg}"] = cost
            floor = floors.get(cfg, 0.0)
            ratio = f"{cost / floor:5.2f}x" if floor else "   - "
            print(f"  {layout:8s} {cfg:9s} {100 * cost:+6.2f} %   floor {100 * floor:5.2f} %   {ratio}")
    for cfg in CONFIGS:
        ratio = statistics.median(r["ms"][f"blocked/{cfg}"] / r["ms"][f"onednn/{cfg}"] for r in rounds)
        summary[f"blocked_over_onednn/{cfg}"] = ratio
        print(f"  step blocked / onednn {cfg:9s} {ratio:.3f}")
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "floors": floors, "rounds": rounds}
    write_json(args.out, {**record, "summary": summary})


if __name__ == "__main__":
    main()
