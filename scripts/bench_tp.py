"""Tensor parallelism on the torch_xla CPU mesh: the collectives of one decode step read from the compiled HLO, and
each device's memory, both beside their Megatron floors.

    PJRT_DEVICE=CPU .venv-xla/bin/python -m scripts.bench_tp [--tp 4] [--shape bench|llama70b] [--layers L]
        [--fully-sharded-loras]

One SPMD program over ``--devices`` virtual CPU devices (default: --tp), N = ``--tp`` shards: the engine serves
``--tokens`` requests on as many rank-16 adapters (every projection) through the sharded pool; the first decode step's
graph is compiled then, and its optimized HLO (XLA_FLAGS --xla_dump_to) lists every collective with its shape.

Floors: collectives, Megatron's 2 all-reduces of [T, hidden] per layer plus the vocabulary-parallel embedding's one,
and 0 for LoRA (it joins each row-parallel layer's partial sum before the all-reduce; fully sharded, each part's
shrink output [T, r] summed over the shards: 4 all-reduces a layer, q/k/v's and gate/up's parts joined); the
logits may come back as one all-gather of [rows, vocab] (printed on its own line). Memory, 1/N of the base weights and
of the pool's rows plus what stays whole (norms, the RoPE table). ``llama70b``: Llama-3.1-70B's layer shapes (hidden
8192, 64 heads, 8 KV heads, MLP 28672) with a 32,000-token vocabulary and ``--layers`` layers (random weights, bf16).
On a 2-core machine the step time of N virtual devices is no speed figure (they share the cores): this prints none.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

_DUMP: Path | None = None  # where XLA writes the optimized HLO (--device xla)


def _environment(devices: int) -> None:
    global _DUMP
    _DUMP = Path(tempfile.mkdtemp(prefix="bench-tp-hlo-"))
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["CPU_NUM_DEVICES"] = str(devices)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"


_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(")
_SHAPE = re.compile(r"(bf16|f16|f32|f64|s32|s64|u32|pred)\[([0-9,]*)\]")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "s64": 8, "u32": 4, "pred": 1}


def collectives(text: str) -> list[tuple[str, str, int]]:
    """(kind, result shape, bytes) of every collective in one optimized HLO module."""
    found = []
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match and "-start" not in line.split("=")[1][:40]:
            shapes = _SHAPE.findall(match.group(1))
            nbytes = sum(_BYTES[t] * math.prod(int(n) for n in d.split(",") if n) for t, d in shapes)
            found.append((match.group(2), match.group(1).strip(), nbytes))
    return found


def _new_modules(seen: set[Path]) -> list[Path]:
    if _DUMP is None:
        return []
    files = [p for p in _DUMP.glob("*after_optimizations.txt") if p not in seen]
    seen.update(files)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--devices", type=int, default=None, help="virtual CPU devices (default: --tp)")
    parser.add_argument("--shape", choices=("bench", "llama70b"), default="bench")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: the shape's; llama70b: 1)")
    parser.add_argument("--tokens", type=int, default=4, help="decode tokens in the step (one request each)")
    parser.add_argument("--device", choices=("xla", "cpu"), default="xla", help="cpu: one process per shard (gloo)")
    parser.add_argument(
        "--fully-sharded-loras", action="store_true", help="split every A and Bt too (one all-reduce per linear)"
    )
    parser.add_argument("--out", default="bench_tp.json")
    args = parser.parse_args()
    if args.device == "xla":
        _environment(args.devices or args.tp)
    work = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    try:
        _run(args, work)
    finally:  # the random checkpoint, the adapters and the HLO dumps
        shutil.rmtree(work, ignore_errors=True)
        if _DUMP is not None:
            shutil.rmtree(_DUMP, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> None:
    from dataclasses import replace

    import torch

    from adapter_manager import (
        AdapterManager,
        AdapterManagerConfig,
        RowOptions,
        TensorParallel,
        write_synthetic_adapter,
    )
    from adapter_manager.runtime.engine.engine import Engine, EngineConfig
    from adapter_manager.runtime.engine.sampling import SamplingParams
    from adapter_manager.runtime.engine.scheduler import SchedulerConfig
    from adapter_manager.runtime.engine.shard_workers import ShardLaunch, start_shard_workers
    from adapter_manager.runtime.model.checkpoint import hf_tensor_shapes, load_model, write_random_checkpoint
    from adapter_manager.runtime.model.config import LlamaConfig
    from scripts.harness.results import cpu_model, write_json

    on_xla, workers = args.device == "xla", None
    if on_xla:
        import torch_xla
        import torch_xla.runtime as xr

        from adapter_manager.spmd import mesh

        mesh(args.tp)
        device = torch_xla.device()
        where = f"{xr.global_runtime_device_count()} XLA devices (PJRT_DEVICE={os.environ['PJRT_DEVICE']})"
    else:
        device, where = torch.device("cpu"), f"{args.tp} processes (gloo on loopback)"
    if args.shape == "llama70b":
        config = replace(
            LlamaConfig.bench(), hidden_size=8192, num_heads=64, num_kv_heads=8, head_dim=128,
            intermediate_size=28672, vocab_size=32000, num_layers=args.layers or 1,
        )  # fmt: skip
        dtype = torch.bfloat16
    else:
        config = replace(LlamaConfig.bench(), num_layers=args.layers or LlamaConfig.bench().num_layers)
        dtype = torch.float32
    write_random_checkpoint(config, work / "base", dtype=dtype)
    if on_xla:
        plan = TensorParallel(args.tp, args.fully_sharded_loras)
        model = load_model(work / "base", dtype=dtype, device=device, tensor_parallel=plan)
    else:
        workers = start_shard_workers(ShardLaunch(work / "base", plan, dtype))
        model = workers.load_model()
    group = model.shard_group
    spec = model.config.to_spec("bench-tp")
    manager = AdapterManager(
        spec,
        AdapterManagerConfig(
            max_slots=args.tokens, device=device, dtype=dtype, prefetch_workers=0, host_cache_bytes=1 << 36,
            rows=RowOptions(max_rank=16, tensor_parallel=TensorParallel(args.tp, args.fully_sharded_loras)),
        ),
    )  # fmt: skip
    for i in range(args.tokens):
        write_synthetic_adapter(work / f"a{i}", spec, r=16, seed=i, dtype=dtype)
        manager.register(str(work / f"a{i}"), adapter_id=f"a{i}")
    budget, prompt = 128, 24
    engine_config = EngineConfig(
        max_batch=args.tokens, max_seq_len=64, scheduler=SchedulerConfig(token_budget=budget),
        token_buckets=(args.tokens, budget), eos_ids=(),
    )  # fmt: skip
    engine = Engine(model, manager, engine_config)
    seen: set[Path] = set()
    _new_modules(seen)
    for i in range(args.tokens):
        engine.submit(list(range(1, prompt + 1)), f"a{i}", SamplingParams(max_tokens=4))
    engine.step()  # the prefill step: every prompt in one bucket-128 step
    _new_modules(seen)
    counted = (group.collectives, group.collective_bytes) if group is not None else (0, 0)
    engine.step()  # the first decode step: T tokens, its own bucket, compiled now
    step_modules = _new_modules(seen)
    item = dtype.itemsize
    t, hidden, layers, n = args.tokens, config.hidden_size, config.num_layers, args.tp
    floor = (2 * layers + 1) * t * hidden * item
    if group is not None:  # counted: the all-reduces, then the logits' all-gather of [T, vocab / N]
        ops, nbytes = group.collectives - counted[0], group.collective_bytes - counted[1]
        gather = t * (config.vocab_size // n) * item
        megatron = 2 * layers + 1  # the all-reduces of [T, hidden]; the rest are the fully sharded shrinks'
        found = [("all-reduce", f"[{t}, {hidden}]", t * hidden * item)] * megatron
        lora_ops, lora_bytes = ops - megatron - 1, nbytes - megatron * t * hidden * item - gather
        if lora_ops:  # their shapes are not recorded: one entry with their total
            found += [("all-reduce", f"{lora_ops} LoRA shrink outputs", lora_bytes)]
        found += [("all-gather", f"[{t}, {config.vocab_size // n}] (the logits)", gather)]
        assert sum(c[2] for c in found) == nbytes and (lora_ops > 0) == args.fully_sharded_loras, (found, nbytes)
    else:
        found = [c for path in step_modules for c in collectives(path.read_text())]
    engine.run_until_idle(max_steps=20)
    reduces = [c for c in found if c[0] == "all-reduce"]
    reduce_ops = len(reduces) + (lora_ops - 1 if group is not None and lora_ops else 0)
    others = [c for c in found if c[0] != "all-reduce"]
    print(
        f"CPU: {cpu_model()}; {where}, TP = {n}, {args.shape} "
        f"shapes ({layers} layers, hidden {hidden}, {dtype}), decode step of {t} tokens on {t} adapters"
    )
    rank = 16  # the adapters' (and the pool's max) rank: each token's shrink output is [r]
    lora_floor = 7 * layers * t * rank * item if args.fully_sharded_loras else 0  # every part's [T, r] summed
    print(
        f"all-reduce: {reduce_ops} ops, {sum(c[2] for c in reduces):,} B | Megatron floor: {2 * layers + 1} "
        f"(2 per layer + the embedding's) of [{t}, {hidden}] = {floor:,} B; LoRA floor {lora_floor:,} B"
        + (f" (each part's shrink output [{t}, {rank}] summed: 4 all-reduces per layer)" if lora_floor else "")
    )
    for kind, shape, nbytes in others:
        print(f"  also {kind} {shape}: {nbytes:,} B")
    if on_xla:
        memory = _device_memory(model, manager, n)
    else:  # this process's shard, against the whole checkpoint
        whole = sum(torch.Size(shape).numel() for shape in hf_tensor_shapes(config).values()) * item
        caches = [t for cache in model.kv_caches for t in (cache.k, cache.v)]
        memory = {
            "base weights": (sum(v.numel() * v.element_size() for v in model.state_dict().values()), whole),
            "KV cache": (sum(c.numel() * c.element_size() for c in caches), n * sum(c.nbytes for c in caches)),
            "pool rows": (manager.pool_nbytes // n, manager.pool_nbytes),  # each shard's section; rank 0 keeps all
        }
    for name, (local, whole) in memory.items():
        print(
            f"{name:>12}: {local / 2**20:9.2f} MiB per device | floor whole/N {whole / n / 2**20:9.2f} MiB "
            f"(whole {whole / 2**20:9.2f} MiB)"
        )
    from adapter_manager.tiers.row_layout import RowLayout

    unsharded = manager.pool_nbytes * RowLayout.of(spec).width // manager.pool.layout.width
    whole_parts = "none: fully sharded" if args.fully_sharded_loras else "A of q/k/v/gate/up and Bt of o/down"
    print(
        f"{'':>12}  the unsharded pool / N: {unsharded / n / 2**20:.2f} MiB (whole on every device: {whole_parts}; "
        "KV heads' Bt where KV < N)"
    )
    print("step time: none printed (the N shards share this machine's cores: a correctness run, not a speed one)")
    write_json(args.out, {
        "tp": n, "shape": args.shape, "layers": layers, "tokens": t, "dtype": str(dtype),
        "collectives": [{"kind": k, "shape": s, "bytes": b} for k, s, b in found],
        "all_reduce_ops": reduce_ops, "all_reduce_bytes": sum(c[2] for c in reduces), "floor_bytes": floor,
        "lora_floor_bytes": lora_floor, "fully_sharded_loras": args.fully_sharded_loras,
        "memory_per_device": {k: {"local": v[0], "whole": v[1]} for k, v in memory.items()},
    })  # fmt: skip
    manager.close()
    if workers is not None:
        workers.close()


def _device_memory(model, manager, shards: int) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    """(bytes on one device, bytes whole) of the base weights, the KV caches and the pool: a tensor split over the
    mesh counts 1/N on a device, a whole one all of it."""
    import torch_xla

    def split(tensors) -> tuple[int, int]:  # noqa: ANN001
        local = whole = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            sharded = "devices=" in torch_xla._XLAC._get_xla_sharding_spec(tensor)
            local, whole = local + (nbytes // shards if sharded else nbytes), whole + nbytes
        return local, whole

    caches = [t for cache in model.kv_caches for t in (cache.k, cache.v)]
    return {
        "base weights": split(list(model.parameters())),
        "KV cache": split(caches),
        "pool rows": (manager.pool_device_nbytes, manager.pool_nbytes),
    }


if __name__ == "__main__":
    main()
