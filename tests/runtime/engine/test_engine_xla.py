"""The model and the engine on the torch_xla CPU device (XLA lane): PEFT per row, and a flat compile count.

Tolerance: fp32 on the XLA CPU device, each row's logits within ``FP32_TOL`` (1e-4, as on CPU) of `PeftModel` with
that row's adapter alone. The engine pads each step's tokens to a bucket; after ``warm_up`` (every bucket, every slot
filled) a 200-step trace with arrivals, departures, swaps and changing adapter mixes, then echo (prompt_logprobs)
requests, compile nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

from adapter_manager import AdapterManager, AdapterManagerConfig, RowOptions
from adapter_manager.kernels import LoRAKernelMeta, select_backend
from adapter_manager.runtime.engine.engine import Engine, EngineConfig
from adapter_manager.runtime.engine.kv_space import block_bytes
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.model.batch import ForwardBatch, SequenceChunk, StaticPadding
from adapter_manager.runtime.model.checkpoint import load_model
from tests.conftest import TINY_NAME
from tests.runtime._oracle import (
    ADAPTERS,
    FP32_TOL,
    MAX_RANK,
    ROWS,
    SLOTTED,
    int8_copy,
    int8_generate,
    max_diff,
    oracle_logits,
    slots_of,
)
from tests.runtime._oracle import ENGINE_NEW_TOKENS as NEW_TOKENS
from tests.runtime._steps import prefill_logits, slotted_model

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
pytest.importorskip("peft")

import torch_xla.debug.metrics as metrics  # noqa: E402

BUCKETS = (8, 16, 32)
TRACE_STEPS = 200


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def test_mixed_batch_logits_equal_peft_per_row_on_xla(written):
    """Every row of a ragged mixed batch (4 adapters in slots + base rows), then again after a slot swap."""
    device = torch_xla.device()
    model, registry, pool, rows = slotted_model(written, device=device)
    meta = LoRAKernelMeta.make(select_backend(device), pool.num_slots, MAX_RANK, 64, device, granule=pool.granule)
    prompts, adapters = [p for p, _ in ROWS], [a for _, a in ROWS]
    layouts = [SLOTTED, tuple("spare" if name == "patterns" else name for name in SLOTTED)]
    for layout in layouts:
        if layout != SLOTTED:
            pool.load(SLOTTED.index("patterns"), registry.prepared("spare"))
            rows[SLOTTED.index("patterns")] = registry.prepared("spare").rows
        names = [name if name in layout or name is None else "spare" for name in adapters]
        ours = prefill_logits(model, prompts, slots_of(names, layout), meta, static=True, slot_rows=rows)
        for logits, prompt, name in zip(ours, prompts, names, strict=True):
            diff = max_diff(logits.cpu(), oracle_logits(written, name, prompt))
            assert diff <= FP32_TOL, (name, diff)


def test_padding_goes_to_the_spare_row():
    chunks = [SequenceChunk(0, 0, (5, 6, 7), 1), SequenceChunk(2, 4, (9,), -1)]
    batch = ForwardBatch.from_chunks(chunks, padding=StaticPadding(tokens=8, logits=3, spare_row=4))
    assert batch.spans is None
    assert batch.tokens.tolist() == [5, 6, 7, 9, 0, 0, 0, 0]
    assert batch.positions.tolist() == [0, 1, 2, 4, 0, 0, 0, 0]
    assert batch.cache_rows.tolist() == [0, 0, 0, 2, 4, 4, 4, 4]
    assert batch.slot_indices.tolist() == [1, 1, 1, -1, -1, -1, -1, -1]
    assert batch.logits_index.tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="padding to 2 tokens"):
        ForwardBatch.from_chunks(chunks, padding=StaticPadding(tokens=2, logits=3, spare_row=4))
    with pytest.raises(ValueError, match="token_buckets"):
        EngineConfig(token_buckets=(16, 8), scheduler=SchedulerConfig(token_budget=8))
    with pytest.raises(ValueError, match="token_buckets"):
        EngineConfig(token_buckets=(8, 16), scheduler=SchedulerConfig(token_budget=32))
    assert EngineConfig(scheduler=SchedulerConfig(token_budget=40)).buckets() == (16, 32, 64)


def test_trace_after_warm_up_compiles_nothing_and_matches_peft(written, expected):
    """Warm-up over every (token bucket, active width, logits rows) with every slot filled, then 200 steps with
    arrivals, departures, swaps (5 adapters through 2 slots), changing mixes, prefix-cache hits and preemptions (a
    pool of 8 KV blocks), then echo (prompt_logprobs) requests: no compile, and every greedy generation equals HF
    `generate`."""
    device = torch_xla.device()
    model = load_model(written[None][0], dtype=torch.float32, device=device)
    spec = model.config.to_spec(TINY_NAME)
    # no prefetch threads: which step admits a request must not depend on when a copier thread ran, or whether the
    # trace preempts at all would be a race (it once did not, in a full lane)
    config = AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=MAX_RANK), device=device, prefetch_workers=0)
    manager = AdapterManager(spec, config)
    for name in ADAPTERS:
        manager.register(str(written[name][0]), adapter_id=name)
    # blocks of 4 tokens, 8 of them (one sequence of 32) for 4 sequences: prefix hits and preemptions
    kv_bytes = 8 * block_bytes(model.config, torch.float32, 4)
    config = EngineConfig(
        max_batch=4,
        max_seq_len=32,
        scheduler=SchedulerConfig(token_budget=32),
        token_buckets=BUCKETS,
        eos_ids=(),
        kv_block_size=4,
        kv_cache_bytes=kv_bytes,
    )
    engine = Engine(model, manager, config)
    try:
        manager.release(manager.acquire(["qv", "all_rslora"]))  # every slot filled
        # active tables of width 1 and 2 (two units, rank <= granule), each with logits rows for max_batch and for
        # an echo step (one per token: every bucket exceeds max_batch 4)
        assert engine.warm_up() == 2 * 2 * len(BUCKETS)
        warmed = compile_count()
        loads_before = manager.metrics().moves["host_to_slot"].count
        combos = sorted(expected, key=str)
        rng = random.Random(0)
        handles, mixes, buckets_seen = [], set(), set()
        for step in range(TRACE_STEPS):
            arrivals = rng.choice((0, 0, 1, 1, 2)) if step < TRACE_STEPS - 30 else 0
            for _ in range(arrivals):
                prompt, name = rng.choice(combos)
                params = SamplingParams(max_tokens=rng.randint(1, NEW_TOKENS))
                handles.append((engine.submit(prompt, name, params), prompt, name, params.max_tokens))
            running = {r.adapter_id for r in engine._running}
            stats = engine.step()
            mixes.add(frozenset(running | {None}))
            if stats.tokens:
                buckets_seen.add(next(b for b in BUCKETS if b >= stats.tokens))
        assert compile_count() == warmed, "a step after warm-up compiled"
        assert not engine.has_work
        kv = engine.kv_metrics()
        assert kv.prefix_hit_tokens > 0 and kv.preemptions > 0, kv  # both happened, and compiled nothing
        assert manager.metrics().moves["host_to_slot"].count - loads_before >= len(ADAPTERS)  # swaps happened
        assert len(mixes) >= 4 and len(buckets_seen) >= 2, (mixes, buckets_seen)
        for handle, prompt, name, max_tokens in handles:
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)][:max_tokens], (prompt, name)

        # echo (prompt_logprobs): a prefill step asks for one logits row per token, padded to the token bucket
        echoes = [(engine.submit(p, a, SamplingParams(max_tokens=2, prompt_logprobs=2)), p, a) for p, a in combos]
        engine.run_until_idle(max_steps=100)
        assert compile_count() == warmed, "an echo (prompt_logprobs) step after warm-up compiled"
        for handle, prompt, name in echoes:
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)][:2], (prompt, name)
            assert len(handle.prompt_logprobs) == len(prompt), (prompt, name)
    finally:
        manager.close()


def test_logprobs_and_prompt_logprobs_on_xla_equal_peft(written):
    """A step with a prompt-scoring row asks for every prompt position's logits (padded to the token bucket); the
    logprobs equal log_softmax of PEFT's logits, and the plain row beside it still decodes HF's greedy tokens."""
    device = torch_xla.device()
    model = load_model(written[None][0], dtype=torch.float32, device=device)
    manager = AdapterManager(
        model.config.to_spec(TINY_NAME),
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=MAX_RANK), device=device),
    )
    manager.register(str(written["qv"][0]), adapter_id="qv")
    config = EngineConfig(
        max_batch=4, max_seq_len=32, scheduler=SchedulerConfig(token_budget=16), token_buckets=(16,), eos_ids=()
    )
    engine = Engine(model, manager, config)
    try:
        prompt = [4, 60, 4, 33, 4, 17, 4, 9, 12]
        scored = engine.submit(prompt, "qv", SamplingParams(max_tokens=3, logprobs=4, prompt_logprobs=4))
        plain = engine.submit([2, 8, 33], None, SamplingParams(max_tokens=3, logprobs=2))
        engine.run_until_idle(max_steps=20)
        output = scored.result(timeout=0)
        reference = torch.log_softmax(oracle_logits(written, "qv", prompt + output), -1)
        entries = [(scored.prompt_logprobs[i], reference[i - 1]) for i in range(1, len(prompt))]
        entries += [(lp, reference[len(prompt) + j - 1]) for j, lp in enumerate(scored.logprobs)]
        for lp, ref in entries:
            assert abs(lp.logprob - ref[lp.token].item()) < FP32_TOL
            assert [t for t, _ in lp.top] == ref.topk(4).indices.tolist()
        base = plain.result(timeout=0)
        base_ref = torch.log_softmax(oracle_logits(written, None, [2, 8, 33] + base), -1)
        assert base == base_ref[2 : 2 + len(base)].argmax(-1).tolist()
        assert all(abs(lp.logprob - base_ref[2 + j, lp.token].item()) < FP32_TOL for j, lp in enumerate(plain.logprobs))
    finally:
        manager.close()


def test_an_int8_base_on_xla_matches_peft_on_the_dequantized_base_and_compiles_nothing_after_warm_up(written):
    """``quantize="int8"`` on the XLA device: the int8 weights dequantized inside each matmul (static shapes), the
    adapters' rows in fp32. The base prefill equals HF on the dequantized weights; after warm-up, mixed requests over
    2 slots generate PEFT's tokens on that base and compile nothing."""
    device = torch_xla.device()
    model = load_model(written[None][0], dtype=torch.float32, device=device, quantize="int8")
    assert model.weight_layout == "int8"
    spec = model.config.to_spec(TINY_NAME)
    manager = AdapterManager(spec, AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=MAX_RANK), device=device))
    for name in ADAPTERS:
        manager.register(str(written[name][0]), adapter_id=name)
    config = EngineConfig(
        max_batch=4, max_seq_len=32, scheduler=SchedulerConfig(token_budget=32), token_buckets=BUCKETS, eos_ids=()
    )
    engine = Engine(model, manager, config)
    requests = [(p, a) for p, a in ROWS[:5]] + [([3, 1, 4, 1, 5], "spare")]
    expected = int8_generate(written, requests)
    try:
        manager.release(manager.acquire(["qv", "all_rslora"]))
        engine.warm_up()
        warmed = compile_count()
        handles = [engine.submit(p, a, SamplingParams(max_tokens=NEW_TOKENS)) for p, a in requests]
        engine.run_until_idle(max_steps=300)
        assert compile_count() == warmed, "an int8 step after warm-up compiled"
        for handle, (prompt, name) in zip(handles, requests, strict=True):
            assert handle.result(timeout=0) == expected[(tuple(prompt), name)], (prompt, name)
    finally:
        manager.close()
    hf = int8_copy(written[None][1])
    base = load_model(written[None][0], dtype=torch.float32, device=device, quantize="int8")
    base.setup_caches(max_batch=2, max_seq_len=32)
    prompts = [ROWS[0][0], ROWS[2][0]]
    for logits, prompt in zip(prefill_logits(base, prompts, static=True), prompts, strict=True):
        with torch.no_grad():
            oracle = hf(input_ids=torch.tensor([prompt])).logits[0].float()
        assert max_diff(logits.cpu(), oracle) <= FP32_TOL
