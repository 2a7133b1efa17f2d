#!/usr/bin/env python3
"""The eager engine against the machine's roofline: decode step and prefill on the bench model, base and LoRA.

Measured side by side in one run (medians), on the CPU by default:
- references: the decode step's weight matmuls alone (M = sequences, every base weight of the step once, lm_head
  included) done the fastest way this machine allows (min over ``x @ W.T``, ``W @ x.T``, oneDNN's packed linear and
  ours on the blocked layout);
  one read pass over the same bytes (the memory floor); the machine's GEMM throughput (M = 1024 on the largest
  projection, the fastest form) for prefill — all run round-robin with the model's steps, so contention on a
  shared machine hits references and steps alike;
- the model's decode step (``--seqs`` sequences, one token each, ``--context`` tokens of context) and prefill
  (``--prefill`` tokens split over the sequences) for base, LoRA attached with no adapter in the step, 1 adapter,
  8 distinct rank-16 adapters — with packed weights (the default) and, for comparison, plain weights, whose decode
  linears each run their base matmul and LoRA in one ``lora_linear`` call and whose prefill runs oneDNN's linear on
  the dense weight (``--no-plain`` skips it);
- a profile of one packed decode step per config: matmul, attention, other ops, outside any op;
- the real engine's decode step (scheduler, lease, forward, sampling) and ``sample_step()`` alone over the step's rows.

Floors: decode LoRA = the active adapters' weight bytes ÷ the base's (shared/DESIGN.md, Floors); prefill LoRA = LoRA
FLOPs ÷ base FLOPs. Targets (reported, never asserted): decode ≤ 60 ms and ≤ 1.25× the matmul reference; prefill
≥ 70 % of GEMM throughput; LoRA ≤ 1.25× its floor (8 adapters, 1 adapter), no adapter ≤ 1 %; engine overhead
≤ 10 % of the step. Writes out/bench_engine.json.

  .venv/bin/python -m scripts.bench_engine [--seqs 8] [--context 144] [--prefill 1024] [--repeats 15]
      [--no-plain] [--threads N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from adapter_manager.kernels import BackendKind, KernelConfig, LoRAForm
from adapter_manager.runtime.engine.sampling import SampleRow, SamplingBatch, SamplingParams, sample_step
from scripts.harness import (
    CONFIGS,
    RANK,
    References,
    StepSetup,
    adapter_bytes,
    cpu_features,
    engine_step_ms,
    engine_workload,
    interleaved_ms,
    median_ms,
    op_calls,
    prefill_floor,
    profile_step,
    write_json,
)

FORMS = {
    "torch": KernelConfig(backend=BackendKind.TORCH),  # the torch forms' own choice per step
    "segments": KernelConfig(torch_form=LoRAForm.SEGMENTS),
    "grouped": KernelConfig(torch_form=LoRAForm.GROUPED),
    "laned": KernelConfig(torch_form=LoRAForm.LANED),
    "fused": KernelConfig(torch_form=LoRAForm.FUSED),
}
"""The LoRA forms the decode step is compared across (auto: the default backend, FUSED at decode)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=144, help="tokens already cached per sequence at decode")
    parser.add_argument("--prefill", type=int, default=1024, help="prefill tokens, split evenly over --seqs")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-weights comparison")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("out/bench_engine.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_features()}
    print(f"cpu: {results['cpu']}", flush=True)
    with engine_workload(pack_weights=True) as work:
        config = work.config
        models = {"packed": work.model}
        results["load_packed_s"] = round(work.load_s, 2)
        choice = work.model.layout_choice
        results["weight_layout"] = choice.describe() if choice else work.model.weight_layout
        print(f"weight layout (chosen at load): {results['weight_layout']}", flush=True)
        plain = work.load_model(pack_weights=False)
        if not args.no_plain:
            models["plain"] = plain
        refs = References(plain, args.seqs)
        if args.no_plain:
            del plain
        max_tokens = max(args.prefill, args.seqs)
        setups = {name: StepSetup(work, m, args.seqs, args.context, max_tokens) for name, m in models.items()}
        decode_fns = {f"{n}/{c}": setup.step_fn(c, None) for n, setup in setups.items() for c in CONFIGS}
        packed_setup = setups["packed"]
        for name, kernel in FORMS.items():
            for cfg in ("lora_1", "lora_8") if name == "torch" else ("lora_8",):
                decode_fns[f"packed/{cfg}/{name}"] = packed_setup.step_fn(cfg, None, kernel)
        decode_all = interleaved_ms({**decode_fns, **refs.decode}, args.repeats)
        print(f"decode: {json.dumps({k: round(v, 1) for k, v in decode_all.items()})}", flush=True)
        prefill_fns = {f"{n}/{c}": setup.step_fn(c, args.prefill) for n, setup in setups.items() for c in CONFIGS}
        prefill_all = interleaved_ms({**prefill_fns, **refs.prefill}, max(3, args.repeats // 3))
        ref = refs.summary(decode_all, prefill_all)
        results["references"] = {k: round(v, 3) for k, v in ref.items()}
        del refs
        print(f"prefill: {json.dumps({k: round(v, 1) for k, v in prefill_all.items()})}", flush=True)
        profiles = {cfg: profile_step(packed_setup.step_fn(cfg, None)) for cfg in CONFIGS}
        decode_ms = {n: {c: decode_all[f"{n}/{c}"] for c in CONFIGS} for n in setups}
        prefill_ms = {n: {c: prefill_all[f"{n}/{c}"] for c in CONFIGS} for n in setups}
        forms = {k.rsplit("/", 1)[1]: v for k, v in decode_all.items() if k.startswith("packed/lora_8/")}
        forms["auto"] = decode_ms["packed"]["lora_8"]
        torch_1 = decode_all["packed/lora_1/torch"]
        packed_setup.step_fn("lora_8", None)()
        results["lora_8_decode_auto_form"] = packed_setup.meta_for(KernelConfig()).form.value  # type: ignore[union-attr]
        calls = {
            f"{cfg}/{name}": op_calls(packed_setup.step_fn(cfg, None, kernel))
            for cfg in CONFIGS
            for name, kernel in (("auto", KernelConfig()), ("torch", FORMS["torch"]))
        }
        for setup in setups.values():
            setup.close()
        flat = torch.randn(args.seqs, config.vocab_size)  # a nucleus of ~half the vocabulary: the full sort
        peaked = flat * 6  # a nucleus of tens of tokens at top_p 0.9, as a trained model's: the candidates' sort
        sampling = {}
        top_p = SamplingParams(temperature=0.8, top_p=0.9)
        for name, params, logits in (
            ("greedy", SamplingParams(), flat),
            ("top_p", top_p, flat),
            ("top_p_peaked", top_p, peaked),
        ):
            rows = [SampleRow(i, params, (1, 2, 3), (3,), frozenset(), 0.5) for i in range(args.seqs)]
            plan = SamplingBatch.make(rows, (), config.vocab_size, "cpu")
            sampling[f"{name}_ms"] = median_ms(lambda plan=plan, lg=logits: sample_step(lg, plan), args.repeats)
        engine = {
            cfg: engine_step_ms(work, work.mix(cfg, args.seqs), args.context, 12) for cfg in ("lora_none", "lora_8")
        }

    base_bytes = ref["base_weight_bytes"]
    floors = {
        "lora_none": 0.0,
        "lora_1": adapter_bytes(config, 1, 4) / base_bytes,
        "lora_8": adapter_bytes(config, 8, 4) / base_bytes,
    }
    prefill_tokens = (args.prefill // args.seqs) * args.seqs
    hidden, heads = config.hidden_size, (config.num_heads + config.num_kv_heads) * config.head_dim
    proj_params = config.num_layers * (2 * hidden * heads + 3 * hidden * config.intermediate_size)
    prefill_flops = 2 * prefill_tokens * proj_params + 2 * args.seqs * hidden * config.vocab_size  # lm_head: last rows
    packed_decode, packed_prefill = decode_ms["packed"], prefill_ms["packed"]
    summary = {
        "decode_base_ms": packed_decode["base"],
        "decode_vs_matmul_ref": packed_decode["base"] / ref["matmul_ref_ms"],
        "decode_vs_read_floor": packed_decode["base"] / ref["read_pass_ms"],
        "prefill_gemm_fraction": prefill_flops / packed_prefill["base"] / 1e6 / ref["gemm_gflop_s"],
        "lora_decode_cost": {c: packed_decode[c] / packed_decode["base"] - 1 for c in CONFIGS[1:]},
        "lora_decode_floor": floors,
        "lora_prefill_cost": {c: packed_prefill[c] / packed_prefill["base"] - 1 for c in CONFIGS[1:]},
        "lora_prefill_floor": {
            "lora_none": 0.0,
            **dict.fromkeys(("lora_1", "lora_8"), prefill_floor(config, RANK, args.prefill // args.seqs)),
        },
        "plain": {  # plain weights (lora_linear at decode), beside the packed default in the same rounds
            "decode_vs_packed": {c: decode_ms["plain"][c] / packed_decode[c] for c in CONFIGS},
            "lora_decode_cost": {c: decode_ms["plain"][c] / decode_ms["plain"]["base"] - 1 for c in CONFIGS[1:]},
            "prefill_vs_packed": {c: prefill_ms["plain"][c] / packed_prefill[c] for c in CONFIGS},
        }
        if "plain" in decode_ms
        else None,
        "engine_step_ms": engine,
        "engine_overhead": {c: engine[c]["overhead"] for c in engine},  # over each step's own forward
        "sampling": sampling,
    }
    results.update(
        lora_8_decode_forms=forms,
        lora_1_decode_torch_ms=torch_1,
        decode_op_calls=calls,
        decode_ms=decode_ms,
        prefill_ms=prefill_ms,
        profile=profiles,
        summary=summary,
    )

    print(f"\nreferences (same run): {json.dumps(results['references'])}")
    print(f"\ndecode step, {args.seqs} sequences at context {args.context} (ms, medians of round-robin runs)")
    for name, row in decode_ms.items():
        print(f"  {name:7s} " + "  ".join(f"{c} {v:7.1f}" for c, v in row.items()))
    print(f"  matmul reference {ref['matmul_ref_ms']:.1f} ms (fastest chain), read floor {ref['read_pass_ms']:.1f} ms")
    s = summary
    print(
        f"  base {s['decode_base_ms']:.1f} ms (target <= 60) = {s['decode_vs_matmul_ref']:.2f}x the matmul reference "
        f"(target <= 1.25x), {s['decode_vs_read_floor']:.2f}x one read pass of the weights"
    )
    for c in CONFIGS[1:]:
        cost, floor = s["lora_decode_cost"][c], floors[c]
        bound = 0.01 if c == "lora_none" else 1.25 * floor
        print(f"  {c:9s} cost {100 * cost:+6.1f} %  floor {100 * floor:5.1f} %  target <= {100 * bound:5.1f} %")
    if s["plain"] is not None:
        plain = s["plain"]
        print(
            "  plain weights (one lora_linear call per decode linear): "
            + ", ".join(f"{c} {100 * v:+.1f} %" for c, v in plain["lora_decode_cost"].items())
            + " over plain base; plain / packed "
            + ", ".join(f"{c} {v:.3f}" for c, v in plain["decode_vs_packed"].items())
        )
    print(f"  lora_8 decode by eager LoRA form (ms): {forms}; auto took {results['lora_8_decode_auto_form']}")
    base = packed_decode["base"]
    print(
        f"  the torch backend (the torch forms) in the same run: lora_1 {100 * (torch_1 / base - 1):+.1f} %, "
        f"lora_8 {100 * (forms['torch'] / base - 1):+.1f} %"
    )
    print(
        "  operator calls per decode step (profiler events; auto / torch backend): "
        + ", ".join(f"{c} {calls[f'{c}/auto']} / {calls[f'{c}/torch']}" for c in CONFIGS)
    )
    print(f"\nprefill {prefill_tokens} tokens over {args.seqs} sequences (ms)")
    for name, row in prefill_ms.items():
        print(f"  {name:7s} " + "  ".join(f"{c} {v:7.1f}" for c, v in row.items()))
    print(
        f"  base reaches {100 * s['prefill_gemm_fraction']:.0f} % of the measured GEMM throughput "
        f"({ref['gemm_gflop_s']:.0f} GFLOP/s; target >= 70 %)"
    )
    for c in CONFIGS[1:]:
        cost, floor = s["lora_prefill_cost"][c], s["lora_prefill_floor"][c]
        bound = max(1.25 * floor, 0.01)
        print(f"  {c:9s} cost {100 * cost:+6.1f} %  floor {100 * floor:5.1f} %  target <= {100 * bound:5.1f} %")
    if s["plain"] is not None:
        print(
            "  plain weights (oneDNN's linear on the dense weight) / packed: "
            + ", ".join(f"{c} {v:.3f}" for c, v in s["plain"]["prefill_vs_packed"].items())
        )
    print("\nprofile of one packed decode step (self ms by category)")
    for cfg, cats in profiles.items():
        print(f"  {cfg:9s} " + "  ".join(f"{k} {v:6.1f}" for k, v in cats.items()))
    print(
        "\nengine decode step (ms): "
        + ", ".join(f"{c} {e['step_ms']:.1f} (forward inside it {e['forward_ms']:.1f})" for c, e in engine.items())
        + "; overhead over each step's own forward: "
        + ", ".join(f"{c} {100 * v:+.1f} %" for c, v in s["engine_overhead"].items())
        + " (target <= 10 %)"
    )
    print(f"sample_step() over {args.seqs} rows (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in sampling.items()))
    write_json(args.out, results, default=float)


if __name__ == "__main__":
    main()
