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

  PYTHONPATH=. .venv/bin/python scripts/bench_engine.py [--seqs 8] [--context 144] [--prefill 1024] [--repeats 15]
      [--no-plain] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _bench_setup import (
    CONFIGS,
    RANK,
    EngineWorkload,
    adapter_bytes,
    engine_step_ms,
    engine_workload,
    prefill_floor,
)

from kernels import BackendKind, KernelConfig, LoRAForm, LoRAKernelMeta, select_backend
from kernels import cpu as cpu_kernels
from kernels.cpu import weights as packing
from runtime.engine.sampling import SampleRow, SamplingBatch, SamplingParams, sample_step
from runtime.model.batch import ForwardBatch, SequenceChunk
from runtime.model.llama import Llama
from runtime.model.projection import LoRALinear


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def cpu_features() -> dict[str, object]:
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "amx": "amx_tile" in flags,
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


def base_linears(model: Llama) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


class References:
    """The references, as closures run in the same round-robin as the model's steps (so contention hits both)."""

    def __init__(self, plain: Llama, seqs: int) -> None:
        weights = [m.weight.detach() for m in base_linears(plain)]
        packs = [packing.onednn_pack(w) for w in weights] if packing.can_pack(weights[0]) else []
        fp32 = weights[0].dtype == torch.float32 and cpu_kernels.load()
        blocks = [cpu_kernels.block_weight(w) for w in weights] if fp32 else []
        inputs = {w.shape[1]: torch.randn(seqs, w.shape[1], dtype=w.dtype) for w in weights}
        self.decode: dict[str, Callable[[], object]] = {
            "ref/x_wt": lambda: [inputs[w.shape[1]] @ w.t() for w in weights],
            "ref/w_xt": lambda: [w @ inputs[w.shape[1]].t() for w in weights],
        }
        if packs:
            self.decode["ref/onednn"] = lambda: [
                packing.onednn_linear(inputs[w.shape[1]], p) for w, p in zip(weights, packs, strict=True)
            ]
        if blocks:
            self.decode["ref/blocked"] = lambda: [
                packing.packed_linear(inputs[w.shape[1]], b, w.shape[0]) for w, b in zip(weights, blocks, strict=True)
            ]
        self.nbytes = sum(w.numel() * w.element_size() for w in weights)
        flat = torch.cat([w.reshape(-1) for w in weights])  # one contiguous copy of the weights' bytes
        self.decode["ref/read"] = lambda: flat.sum()
        largest = max(range(len(weights) - 1), key=lambda i: weights[i].numel())  # a layer's projection
        big = weights[largest]
        self.gemm_flops = 2 * 1024 * big.numel()
        x = torch.randn(1024, big.shape[1], dtype=big.dtype)
        self.prefill: dict[str, Callable[[], object]] = {"ref/gemm_x_wt": lambda: x @ big.t()}
        if packs:
            self.prefill["ref/gemm_onednn"] = lambda: packing.onednn_linear(x, packs[largest])
        if blocks:
            self.prefill["ref/gemm_blocked"] = lambda: packing.packed_linear(x, blocks[largest], big.shape[0])

    def summary(self, decode: dict[str, float], prefill: dict[str, float]) -> dict[str, float]:
        chains = {k.removeprefix("ref/"): v for k, v in decode.items() if k.startswith("ref/") and k != "ref/read"}
        gemm = {k.removeprefix("ref/"): v for k, v in prefill.items() if k.startswith("ref/")}
        out = {f"matmul_chain_{name}_ms": ms for name, ms in chains.items()}
        out["matmul_ref_ms"] = min(chains.values())
        out["read_pass_ms"] = decode["ref/read"]
        out["read_gb_s"] = self.nbytes / decode["ref/read"] / 1e6
        out.update({f"{name}_ms": ms for name, ms in gemm.items()})
        out["gemm_gflop_s"] = self.gemm_flops / min(gemm.values()) / 1e6
        out["base_weight_bytes"] = self.nbytes
        return out


class Setup:
    """One model (packed or plain), its KV cache of ``seqs`` rows prefilled to ``context``, and the LoRA meta."""

    def __init__(self, work: EngineWorkload, model: Llama, seqs: int, context: int, max_tokens: int) -> None:
        self.work, self.model, self.manager = work, model, work.manager
        self.seqs, self.context, self.max_tokens = seqs, context, max_tokens
        model.setup_caches(seqs, context + max_tokens + 2)
        model.attach_lora(self.manager.stacks)  # "base" runs with no metadata: exactly the base model's path
        self.metas: dict[KernelConfig, LoRAKernelMeta] = {}
        self.leases = [self.manager.acquire(self.adapters(cfg)) for cfg in ("lora_1", "lora_8")]  # pinned for the run
        gen = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(0, model.config.vocab_size, (context,), generator=gen) for _ in range(seqs)]
        chunks = [SequenceChunk(row, 0, tuple(p.tolist())) for row, p in enumerate(self.prompts)]
        self.forward(chunks, None, None)

    def meta_for(self, kernel: KernelConfig) -> LoRAKernelMeta:
        """LoRA metadata of the backend ``kernel`` selects (default: the cpu backend, FUSED at decode)."""
        if kernel not in self.metas:
            pool = self.manager.pool
            backend = select_backend(self.model.device, kernel)
            self.metas[kernel] = LoRAKernelMeta.make(
                backend, pool.num_slots, pool.max_rank, self.max_tokens, self.model.device, granule=pool.granule
            )
        return self.metas[kernel]

    def adapters(self, config: str) -> list[str | None]:
        return self.work.mix(config, self.seqs)

    def forward(self, chunks: list[SequenceChunk], meta: LoRAKernelMeta | None, slot_rows) -> torch.Tensor:  # noqa: ANN001
        batch = ForwardBatch.from_chunks(chunks, device=self.model.device)
        if meta is not None:
            assert batch.slot_indices is not None
            meta.prepare(batch.slot_indices, slot_rows)
        with torch.inference_mode():
            return self.model(batch, meta)

    def step_fn(
        self, config: str, prefill: int | None, kernel: KernelConfig | None = None
    ) -> Callable[[], torch.Tensor]:
        """A closure running one decode step (prefill=None) or one prefill of ``prefill`` tokens for ``config``."""
        adapters = self.adapters(config)
        slots, slot_rows = [-1] * self.seqs, {}
        if config != "base":
            lease = self.leases[0] if config == "lora_1" else self.leases[1]
            slots = [-1 if a is None else lease.slots[a] for a in adapters]
            slot_rows = lease.slot_rows
        meta = None if config == "base" else self.meta_for(kernel or KernelConfig())
        if prefill is None:
            chunks = [SequenceChunk(row, self.context, (1,), slot) for row, slot in enumerate(slots)]
        else:
            per = prefill // self.seqs
            chunks = [
                SequenceChunk(row, 0, tuple(self.prompts[row][:per].tolist()) or (1,), slot)
                for row, slot in enumerate(slots)
            ]
        chunks.sort(key=lambda c: c.slot)  # as the engine orders a step
        return lambda: self.forward(chunks, meta, slot_rows)

    def close(self) -> None:
        for lease in self.leases:
            self.manager.release(lease)


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each closure, every round in a fresh (seeded) random order, so contention, drift and the closure
    run just before (a read pass over the weights flushes the caches the next step would find warm) hit all alike:
    a rotation keeps each closure's predecessor fixed and biased the first config (base) by 4-10 %."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {key: [] for key in fns}
    keys, order = list(fns), random.Random(0)
    for _ in range(repeats):
        for key in order.sample(keys, len(keys)):
            start = time.perf_counter()
            fns[key]()
            times[key].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(ts) for key, ts in times.items()}


FORMS = {
    "torch": KernelConfig(backend=BackendKind.TORCH),  # the torch forms' own choice: the default before the cpu backend
    "segments": KernelConfig(torch_form=LoRAForm.SEGMENTS),
    "grouped": KernelConfig(torch_form=LoRAForm.GROUPED),
    "laned": KernelConfig(torch_form=LoRAForm.LANED),
    "fused": KernelConfig(torch_form=LoRAForm.FUSED),
}
"""The LoRA forms the decode step is compared across (auto: the default backend, FUSED at decode)."""


def op_calls(fn: Callable[[], object]) -> int:
    """Operator calls (profiler events) of one call of ``fn``, after one unprofiled call."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return len(prof.events())


def profile_step(fn: Callable[[], object]) -> dict[str, float]:
    """One profiled call: self time per category (ms) and the time outside any op."""
    fn()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    wall = 1e3 * (time.perf_counter() - start)
    cats = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    for event in prof.key_averages():
        name, ms = event.key, event.self_cpu_time_total / 1e3
        if "scaled_dot_product" in name or "flash_attention" in name:
            cats["attention"] += ms
        elif any(k in name for k in ("mm", "linear_pointwise", "matmul", "linear", "lora_apply")):
            cats["matmul"] += ms
        else:
            cats["other_ops"] += ms
    cats["outside_ops"] = max(wall - sum(cats.values()), 0.0)
    cats["profiled_wall"] = wall
    return {k: round(v, 2) for k, v in cats.items()}


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
        plain = work.load_model(pack_weights=False)
        if not args.no_plain:
            models["plain"] = plain
        refs = References(plain, args.seqs)
        if args.no_plain:
            del plain
        max_tokens = max(args.prefill, args.seqs)
        setups = {name: Setup(work, m, args.seqs, args.context, max_tokens) for name, m in models.items()}
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
        f"  the torch backend (the previous default) in the same run: lora_1 {100 * (torch_1 / base - 1):+.1f} %, "
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=float))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
