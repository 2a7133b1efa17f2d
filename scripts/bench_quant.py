#!/usr/bin/env python3
"""The int8 base (``--quantize int8``) against the dtypes it replaces: decode step, LoRA cost, and quality.

Measured side by side in one run (medians of round-robin repeats), on the CPU, per serving dtype (fp32, then bf16:
each its own bench checkpoint and adapter pool):
- the model's decode step (``--seqs`` sequences at ``--context``) with the base weights as loaded (packed in the
  layout measured fastest here) and int8 (every projection and the lm_head; activations and adapters in the dtype),
  for base, 1 adapter and 8 distinct rank-16 adapters;
- references in the same rounds: one read pass over the int8 weights' bytes (q and scales: the memory floor of the
  int8 step) and over the dtype weights' bytes, and the int8 weight matmuls alone (the chain of the step's
  ``kernels.base_linear`` calls: what the model's step could be with nothing else in it).
- quality on a real trained model (SmolLM2-135M-Instruct, the real-model lane's checkpoint, or ``--model DIR``): the
  perplexity of a fixed English text (:data:`TEXT`) in fp32, bf16 and int8 on each, through the model's own
  forward (one prefill, every position's logits).

Floors: the int8 step's LoRA cost against its byte floor counted on int8 base bytes (the adapters' bytes in the
serving dtype ÷ the int8 weights' bytes; shared/DESIGN.md, Floors). Targets (reported, never asserted): int8 decode
step ≤ 0.6× bf16's at 8 sequences; the LoRA-8 cost ≤ 1.25× its floor; the perplexity delta of int8 against bf16.
Writes out/bench_quant.json.

  .venv/bin/python -m scripts.bench_quant [--seqs 8] [--context 144] [--repeats 15] [--model DIR] [--no-quality]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from adapter_manager.kernels import WeightLayout, base_linear
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk
from adapter_manager.runtime.model.checkpoint import load_model
from adapter_manager.runtime.model.llama import Llama
from adapter_manager.runtime.model.tokenizer import load_tokenizer
from scripts.harness import (
    CONFIGS,
    StepSetup,
    adapter_bytes,
    base_linears,
    cpu_features,
    engine_workload,
    interleaved_ms,
    write_json,
)

TEXT = (
    "The river rises in the hills above the town and runs for about forty miles before it reaches the sea. For most "
    "of its length it is slow and wide, and in summer children swim in the deep pools below the old stone bridge. "
    "The bridge was built more than three hundred years ago, when the town was a market for wool and grain, and "
    "farmers from the surrounding valleys brought their goods across it every week. Today the market square is "
    "quieter. A bakery, a bookshop and two cafes face the fountain, and on Saturday mornings a small market still "
    "sells vegetables, cheese, honey and flowers.\n\n"
    "Scientists who study rivers measure how much water flows past a point each second. After heavy rain the flow "
    "can be ten times its usual level, and the water carries sand, stones and branches down from the hills. Over "
    "many years this moves the course of the river, cutting into one bank and building up the other. Maps drawn two "
    "centuries ago show the river passing much closer to the church than it does now.\n\n"
    "To keep the town safe from floods, engineers built walls along the banks and a channel that carries extra water "
    "around the center. When the water is high, gates open and the channel fills. The system has worked well, but "
    "the engineers say that storms are becoming stronger and that the walls may need to be raised. The town council "
    "will discuss the plan next month, and residents have been invited to share their views."
)
"""The fixed text the perplexity is measured on (English prose written for this benchmark, so no model saw it)."""


def weight_bytes(model: Llama) -> int:
    """The bytes a decode step reads of the base weights: every LoRALinear's weight in its layout (int8: q and its
    scales), and a tied lm_head's embedding table."""
    total = 0
    for module in base_linears(model):
        weight = module._weight()  # noqa: SLF001 - bench: the weight as the step reads it
        tensors = [weight.tensor] + ([weight.scales] if weight.scales is not None else [])
        if weight.layout is WeightLayout.ONEDNN:  # opaque: count its plain bytes
            tensors = [torch.empty(module.out_total, module.in_features, dtype=module.weight_dtype)]
        total += sum(t.numel() * t.element_size() for t in tensors)
    if model.output is None:
        total += model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    return total


def chain(model: Llama, seqs: int):  # noqa: ANN201 - a closure
    """The decode step's base matmuls alone, each weight in its own layout through kernels.base_linear."""
    weights = [m._weight() for m in base_linears(model)]  # noqa: SLF001 - bench
    inputs = {m.in_features: torch.randn(seqs, m.in_features, dtype=model.dtype) for m in base_linears(model)}
    sizes = [m.in_features for m in base_linears(model)]
    return lambda: [base_linear(inputs[k], w, fast=True) for k, w in zip(sizes, weights, strict=True)]


def read_pass(nbytes: int):  # noqa: ANN201 - a closure
    flat = torch.ones(nbytes // 4, dtype=torch.float32)
    return lambda: flat.sum()


def decode_figures(dtype: torch.dtype, args: argparse.Namespace) -> dict[str, object]:
    with engine_workload(dtype=dtype, pack_weights=True) as work:
        models = {"dense": work.model, "int8": work.load_model(quantize="int8")}
        layout = work.model.layout_choice.describe() if work.model.layout_choice else work.model.weight_layout
        nbytes = {name: weight_bytes(m) for name, m in models.items()}
        setups = {name: StepSetup(work, m, args.seqs, args.context, args.seqs) for name, m in models.items()}
        fns = {f"{n}/{c}": s.step_fn(c, None) for n, s in setups.items() for c in CONFIGS if c != "lora_none"}
        fns.update({f"ref/read_{n}": read_pass(b) for n, b in nbytes.items()})
        fns.update({f"ref/chain_{n}": chain(m, args.seqs) for n, m in models.items()})
        ms = interleaved_ms(fns, args.repeats)
        for setup in setups.values():
            setup.close()
        element = torch.empty(0, dtype=dtype).element_size()
        out: dict[str, object] = {
            "dense_layout": layout,
            "weight_bytes": nbytes,
            "ms": {k: round(v, 2) for k, v in ms.items()},
        }
        for name in models:
            base = ms[f"{name}/base"]
            out[name] = {
                "step_ms": {c: round(ms[f"{name}/{c}"], 2) for c in ("base", "lora_1", "lora_8")},
                "vs_read_floor": round(base / ms[f"ref/read_{name}"], 2),
                "vs_chain": round(base / ms[f"ref/chain_{name}"], 2),
                "lora_cost": {c: round(ms[f"{name}/{c}"] / base - 1, 4) for c in ("lora_1", "lora_8")},
                "lora_floor": {c: round(adapter_bytes(work.config, k, element) / nbytes[name], 4)
                               for c, k in (("lora_1", 1), ("lora_8", 8))},
            }  # fmt: skip
        out["int8_vs_dense"] = round(ms["int8/base"] / ms["dense/base"], 3)
        return out


def perplexity(model: Llama, ids: list[int]) -> float:
    """exp(mean NLL) of ``ids[1:]`` given their prefixes: one prefill with every position's logits."""
    model.setup_caches(max_batch=1, max_seq_len=len(ids) + 1)
    batch = ForwardBatch.from_chunks([SequenceChunk(0, 0, tuple(ids))], device=model.device, logits="all")
    with torch.inference_mode():
        logits = model(batch, None).float()  # [T, vocab]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


def quality(folder: Path) -> dict[str, object]:
    ids = load_tokenizer(folder, load_model(folder, pack_weights=False).config.vocab_size).encode(TEXT)
    out: dict[str, object] = {"model": str(folder), "tokens": len(ids)}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        out[name] = round(perplexity(load_model(folder, dtype=dtype), ids), 4)
        out[f"int8/{name}"] = round(perplexity(load_model(folder, dtype=dtype, quantize="int8"), ids), 4)
    out["int8_vs_bf16_delta"] = round(out["int8/bfloat16"] - out["bfloat16"], 4)  # type: ignore[operator]
    out["int8_vs_bf16_relative"] = round(out["int8/bfloat16"] / out["bfloat16"] - 1, 5)  # type: ignore[operator]
    return out


def real_model() -> Path:
    """The real-model lane's SmolLM2-135M-Instruct checkpoint (made once per machine: tests/runtime/real_model)."""
    from tests.runtime.real_model._prepare import prepared

    return prepared()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=144)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint for the perplexity (default: SmolLM2)")
    parser.add_argument("--no-quality", action="store_true", help="skip the perplexity on the real model")
    parser.add_argument("--out", type=Path, default=Path("out/bench_quant.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu_features()}
    print(f"cpu: {results['cpu']}", flush=True)
    decode = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        decode[name] = decode_figures(dtype, args)
        print(f"{name}: {json.dumps(decode[name])}", flush=True)
    results["decode"] = decode
    fp32, bf16 = decode["float32"], decode["bfloat16"]
    print(f"\ndecode step, {args.seqs} sequences at context {args.context} (ms, medians of round-robin runs)")
    for dname, row in decode.items():
        for kind in ("dense", "int8"):
            r = row[kind]
            steps = "  ".join(f"{c} {v:7.1f}" for c, v in r["step_ms"].items())
            print(f"  {dname:8s} {kind:5s} {steps}   {r['vs_read_floor']:.2f}x its read floor, {r['vs_chain']:.2f}x "
                  f"its matmul chain; weights {row['weight_bytes'][kind] / 2**20:.0f} MiB")  # fmt: skip
        print(f"  {dname:8s} dense layout: {row['dense_layout']}")
    print(f"  int8 / bf16 (same run): {bf16['int8_vs_dense']:.2f}x (target <= 0.6x); int8 / fp32: "
          f"{fp32['int8_vs_dense']:.2f}x")  # fmt: skip
    for dname, row in decode.items():
        r = row["int8"]
        for c in ("lora_1", "lora_8"):
            cost, floor = r["lora_cost"][c], r["lora_floor"][c]
            print(f"  {dname:8s} int8 {c}: cost {100 * cost:+6.1f} %  floor {100 * floor:5.1f} % (int8 base bytes)  "
                  f"= {cost / floor:.2f}x the floor (target <= 1.25x)")  # fmt: skip
    if not args.no_quality:
        results["quality"] = quality(args.model or real_model())
        q = results["quality"]
        print(f"\nperplexity of the fixed text ({q['tokens']} tokens) on {q['model']}:")
        print(f"  fp32 {q['float32']:.4f}  int8/fp32 {q['int8/float32']:.4f}  bf16 {q['bfloat16']:.4f}  "
              f"int8/bf16 {q['int8/bfloat16']:.4f}  (int8 - bf16: {q['int8_vs_bf16_delta']:+.4f}, "
              f"{100 * q['int8_vs_bf16_relative']:+.2f} %)")  # fmt: skip
    write_json(args.out, results)


if __name__ == "__main__":
    main()
