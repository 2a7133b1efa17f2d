#!/usr/bin/env python3
"""Is the traced (XLA) step batch-invariant as it stands? (whether the deterministic mode could be allowed on XLA)

Two measurements on an XLA device (the torch_xla CPU device here; a TPU with scripts/tpu_figures):
  dots       one base matmul's rows at every bucket of --rows against the same rows in the largest bucket: equal
             bits or not, per shape and dtype (XLA tiles a dot by its shape, so a row may sum in another order);
  engine     a small random Llama with 3 rank-8 adapters on the warmed-up XLA engine: --requests requests (base
             and adapter rows) served one at a time, then together with as many more; how many give the same
             tokens and the same logprob bits.
Reference: the eager CPU default gives 0 of 16 the same logprob bits on the bench model (bench_determinism), the
deterministic mode 16 of 16. Prints a line per measurement and writes out/probe_xla_invariance.json.

  PJRT_DEVICE=CPU .venv-xla/bin/python -m scripts.probes.xla_invariance [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, write_synthetic_adapter
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model, write_random_checkpoint
from adapter_manager.runtime.model.config import LlamaConfig
from scripts.harness import cpu_model, write_json
from scripts.harness.company import answers, same_in_company

SHAPES = ((1024, 1536), (2816, 1024), (576, 49152))  # (in, out): q|k|v-like, down-like, a large vocabulary
CONFIG = LlamaConfig(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=384)


def dots(device: torch.device, dtype: torch.dtype, rows: list[int]) -> list[dict]:
    out = []
    for k, n in SHAPES:
        gen = torch.Generator().manual_seed(k + n)
        w = torch.randn(n, k, generator=gen).to(dtype).to(device)
        x = torch.randn(max(rows), k, generator=gen).to(dtype)
        full = (x.to(device) @ w.t()).cpu()
        same = {m: torch.equal((x[:m].to(device) @ w.t()).cpu(), full[:m]) for m in rows}
        out.append({"in": k, "out": n, "same_as_largest": same})
    return out


def engine(device: torch.device, dtype: torch.dtype, requests: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_random_checkpoint(CONFIG, root / "base", seed=0)
        spec = CONFIG.to_spec("probe")
        ids = [f"a{i}" for i in range(3)]
        for i, name in enumerate(ids):
            write_synthetic_adapter(root / name, spec, r=8, lora_alpha=16, seed=i + 1)
        model = load_model(root / "base", dtype=dtype, device=device)
        manager_config = AdapterManagerConfig(
            max_slots=3, rows=RowOptions(max_rank=8), dtype=dtype, device=device, prefetch_workers=0
        )
        with AdapterManager(spec, manager_config) as manager:
            for name in ids:
                manager.register(str(root / name), adapter_id=name)
            config = EngineConfig(
                max_batch=2 * requests,
                max_seq_len=64,
                scheduler=SchedulerConfig(token_budget=64),
                eos_ids=(),
                prefix_caching=False,
            )
            served = Engine(model, manager, config)
            served.warm_up()
            rng = random.Random(0)
            batch = [
                ([rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randrange(5, 20))], [None, *ids][i % 4])
                for i in range(2 * requests)
            ]
            params = SamplingParams(max_tokens=6, logprobs=1, ignore_eos=True)

            def serve(chosen: list) -> list:
                handles = [served.submit(prompt, adapter, params) for prompt, adapter in chosen]
                served.run_until_idle()
                return answers(handles)

            same = same_in_company(serve, batch, requests)
            served.close()
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16,64,512", help="dot rows to compare (the largest: reference)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("out/probe_xla_invariance.json"))
    args = parser.parse_args()
    import torch_xla

    device = torch_xla.device()
    rows = sorted(int(r) for r in args.rows.split(","))
    print(f"CPU: {cpu_model()}; XLA device {device}", flush=True)
    results = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        row = {"dtype": name, "dots": dots(device, dtype, rows), "engine": engine(device, dtype, args.requests)}
        results.append(row)
        for d in row["dots"]:
            equal = ", ".join(f"{m}: {'=' if same else 'differs'}" for m, same in d["same_as_largest"].items())
            print(f"{name} dot {d['in']}x{d['out']}, rows against {rows[-1]}: {equal}", flush=True)
        e = row["engine"]
        print(
            f"{name} engine: same tokens {e['same_tokens']}/{e['requests']}, same logprobs "
            f"{e['same_logprobs']}/{e['requests']} (alone against together)",
            flush=True,
        )
    write_json(args.out, {"cpu": cpu_model(), "device": str(device), "results": results})


if __name__ == "__main__":
    main()
