"""The deterministic mode (EngineConfig.deterministic): a request's tokens and logprobs are the same bits whatever it
shares a step with. The oracle is each request served alone; every other way of serving the same requests must give
exactly its answers: batches of every size up to max_batch (other adapters and base rows around it, hot swaps through
fewer slots than adapters), chunked prefill at several token budgets, preemption and recompute, prefix-cache hits; in
fp32 and bf16, greedy and seeded sampling; through the CPU library's ops and through the torch forms (CUDA too,
where a GPU is present)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions, write_synthetic_adapter
from adapter_manager.kernels import BackendKind, KernelConfig
from adapter_manager.kernels.cpu import load, unavailable_reason
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.kv_space import block_bytes
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.checkpoint import load_model, write_random_checkpoint
from adapter_manager.runtime.model.config import LlamaConfig

# head_dim 64 with 4 query heads per KV head: the attention op's vector form; a tied lm_head
CONFIG = LlamaConfig(
    hidden_size=512, intermediate_size=704, num_layers=2, num_heads=8, num_kv_heads=2, vocab_size=384,
    tie_word_embeddings=True,
)  # fmt: skip
# a1 a DoRA adapter and a2 a LoRA-bias one: their vector epilogue is per token too
ADAPTERS = {
    "a0": dict(r=8),
    "a1": dict(r=4, target_modules=("q_proj", "v_proj", "down_proj"), variant="dora"),
    "a2": dict(r=8, variant="lora_bias"),
}
MAX_BATCH = 6
NEW_TOKENS = 6


def _requests() -> list[tuple[list[int], str | None, SamplingParams]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, CONFIG.vocab_size) for _ in range(20)]  # a prefix two a0 requests share
    adapters = ["a0", None, "a1", "a2", "a0", None]
    requests = []
    for i, adapter in enumerate(adapters):
        prompt = [rng.randrange(3, CONFIG.vocab_size) for _ in range(rng.randrange(5, 40))]
        if i in (0, 4):
            prompt = shared + prompt
        seeded = i == 3  # sampled with a seed: the same draws in any batch
        params = SamplingParams(
            max_tokens=NEW_TOKENS, logprobs=2, temperature=0.8 if seeded else 0.0, seed=7 if seeded else None
        )
        requests.append((prompt, adapter, params))
    return requests


REQUESTS = _requests()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str | None, Path]:
    root = tmp_path_factory.mktemp("deterministic")
    out: dict[str | None, Path] = {None: write_random_checkpoint(CONFIG, root / "base", seed=0)}
    spec = CONFIG.to_spec("det")
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        out[name] = write_synthetic_adapter(root / name, spec, lora_alpha=16, seed=i + 1, **kwargs)
    return out


# (device, the ops: the CPU library's, or the torch forms a token at a time) x dtype
FORMS = [("cpu", "compiled"), ("cpu", "torch")] + ([("cuda", "torch")] if torch.cuda.is_available() else [])
PARAMS = [(device, ops, dtype) for device, ops in FORMS for dtype in (torch.float32, torch.bfloat16)]


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{d}-{o}-{str(t)[6:]}" for d, o, t in PARAMS])
def served(request, folders):
    """serve(order, **engine options) -> each request's (tokens, logprobs) and the engine's KV metrics. The torch
    forms: attention, norms and the reference backend's LoRA a token at a time (on CPU the base matmuls stay the
    library's fixed_linear; tests/kernels/test_layer_ops.py checks the torch form's)."""
    device, ops, dtype = request.param
    if ops == "compiled" and not load():
        pytest.skip(f"no CPU kernels: {unavailable_reason()}")
    model = load_model(folders[None], dtype=dtype, device=device)
    model.cpu_ops = ops == "compiled"
    kernels = KernelConfig(BackendKind.REFERENCE) if ops == "torch" else None
    manager = AdapterManager(
        CONFIG.to_spec("det"),
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8), dtype=dtype, device=device, prefetch_workers=0),
    )
    for name in ADAPTERS:
        manager.register(str(folders[name]), adapter_id=name)

    def serve(order: list[int], token_budget: int = 64, waves: int = 1, max_seq_len: int = 128, **options):
        scheduler = SchedulerConfig(token_budget=token_budget)
        config = EngineConfig(
            max_batch=MAX_BATCH,
            max_seq_len=max_seq_len,
            scheduler=scheduler,
            eos_ids=(),
            deterministic=True,
            kernels=kernels,
            **options,
        )
        engine = Engine(model, manager, config)
        try:
            handles = {}
            for _ in range(waves):  # waves > 1: the same requests again, after the first ones finished
                handles = {i: engine.submit(*REQUESTS[i]) for i in order}
                engine.run_until_idle()
            answers = {
                i: (h.result(timeout=0), [(lp.token, lp.logprob, lp.top) for lp in h.logprobs])
                for i, h in handles.items()
            }
            return answers, engine.kv_metrics()
        finally:
            engine.close()

    yield serve, dtype
    manager.close()


@pytest.fixture(scope="module")
def alone(served) -> dict[int, tuple]:
    serve, _ = served
    return {i: serve([i], prefix_caching=False)[0][i] for i in range(len(REQUESTS))}


def test_batches_of_every_size_give_each_request_its_answer_alone(served, alone):
    serve, _ = served
    for size in range(2, MAX_BATCH + 1):
        order = random.Random(size).sample(range(len(REQUESTS)), size)
        answers, _ = serve(order)
        assert answers == {i: alone[i] for i in order}, size


@pytest.mark.parametrize("token_budget", [7, 16, 33])
def test_chunked_prefill_at_any_budget_gives_the_same_bits(served, alone, token_budget):
    serve, _ = served
    answers, _ = serve(list(range(len(REQUESTS))), token_budget=token_budget)
    assert answers == alone


def test_preempted_and_recomputed_requests_give_the_same_bits(served, alone):
    serve, dtype = served
    kv_bytes = 18 * block_bytes(CONFIG, dtype, 4)  # blocks of 4: one sequence of max_seq_len, so some are preempted
    answers, kv = serve(list(range(len(REQUESTS))), max_seq_len=64, kv_block_size=4, kv_cache_bytes=kv_bytes)
    assert kv.preemptions > 0, kv
    assert answers == alone


def test_prefix_cache_hits_give_the_same_bits(served, alone):
    serve, _ = served
    answers, kv = serve(list(range(len(REQUESTS))), waves=2)  # the second wave's prompts are cached
    assert kv.prefix_hit_tokens > 0, kv
    assert answers == alone


@pytest.mark.skipif(not load(), reason=f"no CPU kernels: {unavailable_reason()}")
def test_the_mode_unpacks_packed_weights_and_refuses_what_it_cannot_serve(folders):
    manager = AdapterManager(
        CONFIG.to_spec("det"), AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8), prefetch_workers=0)
    )
    try:
        config = EngineConfig(max_batch=2, max_seq_len=32, deterministic=True)
        model = load_model(folders[None], dtype=torch.float32, pack_weights=True)
        assert model.packed
        Engine(model, manager, config).close()
        assert not model.packed and model.weight_layout == "plain"  # the same values, read by fixed_linear
        with pytest.raises(ValueError, match="weights int8"):
            Engine(load_model(folders[None], dtype=torch.float32, quantize="int8"), manager, config)
        torch_forms = EngineConfig(
            max_batch=2, max_seq_len=32, deterministic=True, kernels=KernelConfig(BackendKind.TORCH)
        )
        with pytest.raises(ValueError, match="no batch-invariant form"):  # the torch forms' matmul per run
            Engine(load_model(folders[None], dtype=torch.float32), manager, torch_forms)
    finally:
        manager.close()
