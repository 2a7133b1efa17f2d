"""The tensor-parallel engine trace, run in its own process: on XLA SPMD must be switched on before the first XLA
tensor (the XLA lane's other tests run without it); on CPU this process is rank 0 of a gloo group whose other shards
it starts.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python -m tests.runtime.engine._tp_trace PATHS.json OUT.json --tp N
    python -m tests.runtime.engine._tp_trace PATHS.json OUT.json --tp 2 --device cpu
    ... --fully-sharded-loras       (XLA: every A and Bt split too)
    ... --pallas                    (XLA: the Pallas kernels, interpreted as HLO, run per shard)

PATHS.json maps each adapter name (and "base") to its folder; the first two adapters fill the slots. Warm-up, then a
trace with mixed adapters, swaps (more adapters than the 2 slots), prefix hits and preemptions, then echo
(prompt_logprobs) requests; OUT.json holds every request's tokens, the echoes' prompt logprobs, the compile counts and
the KV / move counters, for the test to compare with PEFT.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, TensorParallel
from adapter_manager.kernels import BackendKind, KernelConfig, PallasInterpret
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.kv_space import block_bytes
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.engine.shard_workers import ShardLaunch, start_shard_workers
from adapter_manager.runtime.model.checkpoint import load_model

BUCKETS = (8, 16, 32)
STEPS = 120
NEW_TOKENS = 6
TINY_NAME = "test-org/tiny-llama"
PALLAS = KernelConfig(xla_backend=BackendKind.PALLAS, pallas_interpret=PallasInterpret.HLO)


def compile_count(device: torch.device) -> int:
    if device.type != "xla":
        return 0
    import torch_xla.debug.metrics as metrics

    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def run(
    paths: dict[str, str],
    combos: list[tuple[list[int], str | None]],
    tp: int,
    on: str,
    full: bool = False,
    pallas: bool = False,
) -> dict:
    workers, calls = None, {"pallas": 0}
    if pallas:  # count the Pallas shrinks traced: the proof the per-shard path ran (it traces every step)
        from adapter_manager.kernels.pallas.backend import PallasBackend

        shrink = PallasBackend.shrink

        def counted(self, *args, **kwargs):
            calls["pallas"] += 1
            return shrink(self, *args, **kwargs)

        PallasBackend.shrink = counted
    if on == "xla":
        import torch_xla

        from adapter_manager.spmd import mesh

        if tp > 1:
            mesh(tp)  # SPMD on before anything touches the XLA device
        device = torch_xla.device()
        plan = TensorParallel(tp, full)
        model = load_model(paths["base"], dtype=torch.float32, device=device, tensor_parallel=plan)
    else:
        device = torch.device("cpu")
        workers = start_shard_workers(ShardLaunch(Path(paths["base"]), TensorParallel(tp, full)))
        model = workers.load_model()
    spec = model.config.to_spec(TINY_NAME)
    config = AdapterManagerConfig(
        max_slots=2,
        rows=RowOptions(max_rank=8, tensor_parallel=TensorParallel(tp, fully_sharded_loras=full)),
        device=device,
        prefetch_workers=0,
    )
    manager = AdapterManager(spec, config)
    for name, folder in paths.items():
        if name != "base":
            manager.register(folder, adapter_id=name)
    kv_bytes = 8 * block_bytes(model.config, torch.float32, 4)  # 8 blocks of 4 tokens for 4 sequences
    engine_config = EngineConfig(
        max_batch=4,
        max_seq_len=32,
        scheduler=SchedulerConfig(token_budget=32),
        token_buckets=BUCKETS,
        eos_ids=(),
        kv_block_size=4,
        kv_cache_bytes=kv_bytes,
        kernels=PALLAS if pallas else None,
    )
    fill = [name for name in paths if name != "base"][:2]
    manager.release(manager.acquire(fill))  # every slot filled before the engine (and its shards) runs
    engine = Engine(model, manager, engine_config)
    try:
        warm_up_graphs = engine.warm_up()
        warmed = compile_count(device)
        rng = random.Random(0)
        handles = []
        for step in range(STEPS):
            for _ in range(rng.choice((0, 0, 1, 1, 2)) if step < STEPS - 30 else 0):
                prompt, name = rng.choice(combos)
                params = SamplingParams(max_tokens=rng.randint(1, NEW_TOKENS))
                handles.append((engine.submit(prompt, name, params), prompt, name))
            engine.step()
        engine.run_until_idle(max_steps=200)
        echoes = [(engine.submit(p, a, SamplingParams(max_tokens=2, prompt_logprobs=2)), p, a) for p, a in combos]
        engine.run_until_idle(max_steps=100)
        kv = engine.kv_metrics()
        return {
            "tp": tp,
            "warm_up_graphs": warm_up_graphs,
            "compiles_after_warm_up": compile_count(device) - warmed,
            "requests": [[prompt, name, h.result(timeout=0)] for h, prompt, name in handles],
            "echoes": [
                [prompt, name, h.result(timeout=0), [[lp.token, lp.logprob] for lp in h.prompt_logprobs[1:]]]
                for h, prompt, name in echoes
            ],
            "prefix_hit_tokens": kv.prefix_hit_tokens,
            "preemptions": kv.preemptions,
            "swaps": manager.metrics().moves["host_to_slot"].count,
            "collectives": None if model.shard_group is None else model.shard_group.collectives,
            "pallas_shrinks": calls["pallas"],
        }
    finally:
        manager.close()
        if workers is not None:
            workers.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--device", choices=("xla", "cpu"), default="xla")
    parser.add_argument("--fully-sharded-loras", action="store_true")
    parser.add_argument("--pallas", action="store_true", help="the Pallas backend, interpreted (HLO), per shard")
    args = parser.parse_args()
    spec = json.loads(args.paths.read_text())
    combos = [(list(prompt), name) for prompt, name in spec["combos"]]
    result = run(spec["paths"], combos, args.tp, args.device, args.fully_sharded_loras, args.pallas)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
