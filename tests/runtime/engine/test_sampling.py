"""Sampling options and logprobs against transformers: the batched sampler's penalties equal HF's logits processors,
the engine's logprobs equal log_softmax of the HF + PEFT logits, and a row's result never depends on its batch."""

from __future__ import annotations

import random

import pytest
import torch

from adapter_manager.runtime.engine.sampling import (
    MAX_LOGPROBS,
    PromptRow,
    SampleRow,
    SamplingBatch,
    SamplingParams,
    SamplingParamsError,
    apply_penalties,
    sample_step,
)
from tests.runtime._oracle import FP32_TOL, oracle_logits

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

VOCAB = 64
NEW = 8


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's formula on the generated tokens: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """The same options as transformers' processors, in vLLM's order (bias, min_tokens, repetition, OpenAI)."""
    out = LogitsProcessorList()
    if params.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.min_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, list(params.stop_ids)))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    out.append(OpenAIPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    return out


OPTIONS = [
    SamplingParams(max_tokens=NEW, repetition_penalty=1.7),
    SamplingParams(max_tokens=NEW, repetition_penalty=0.6),
    SamplingParams(max_tokens=NEW, presence_penalty=1.5, frequency_penalty=0.8),
    SamplingParams(max_tokens=NEW, presence_penalty=-0.5, frequency_penalty=-1.0),
    SamplingParams(max_tokens=NEW, logit_bias={3: 5.0, 7: -100.0, 11: 2.5}),
    SamplingParams(max_tokens=NEW, min_tokens=5, stop_ids=(1, 2, 3)),
    SamplingParams(
        max_tokens=NEW, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={5: 1.0}, min_tokens=2, stop_ids=(9,)
    ),
]


def test_penalties_equal_transformers_logits_processors():
    rng = random.Random(0)
    torch.manual_seed(0)
    rows, raw, expected = [], [], []
    for i, params in enumerate(OPTIONS * 2):  # the second round: no output yet (min_tokens masks, no frequency)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4) if i < len(OPTIONS) else 0)]
        raw.append(torch.randn(VOCAB) * 4)
        rows.append(SampleRow(i, params, (*prompt, *output), output, frozenset(params.stop_ids)))
        expected.append(hf_processors(params, len(prompt))(torch.tensor([prompt + output]), raw[-1][None].clone())[0])
    got = apply_penalties(torch.stack(raw), SamplingBatch.make(rows, [], VOCAB, "cpu"))
    for row, want, have in zip(rows, expected, got, strict=True):
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(have)), row.params
        assert (want[finite] - have[finite]).abs().max() < 1e-5, row.params
        if row.generated:
            assert not torch.equal(want, raw[row.logits_row]), row.params  # every option did something


def test_a_rows_result_is_the_same_alone_and_in_any_batch():
    torch.manual_seed(1)
    params = OPTIONS + [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, logprobs=3),
        SamplingParams(max_tokens=4, temperature=0.9, logprobs=0),
        SamplingParams(max_tokens=4, temperature=1.3, top_p=0.7, logprobs=MAX_LOGPROBS, frequency_penalty=1.0),
        SamplingParams(max_tokens=4, temperature=0.5, top_p=0.95, repetition_penalty=1.2),
    ]
    logits = torch.randn(len(params) + 3, VOCAB) * 3
    rows = [
        SampleRow(i + 2, p, (1, 2, 3, 4, i), (4, i), frozenset(p.stop_ids) | {0}, uniform=random.Random(i).random())
        for i, p in enumerate(params)
    ]
    prompts = [PromptRow(0, 5, 4), PromptRow(1, 6, 0)]
    together = sample_step(logits, SamplingBatch.make(rows, prompts, VOCAB, "cpu"))
    for i, row in enumerate(rows):
        alone = sample_step(logits, SamplingBatch.make([row], [], VOCAB, "cpu"))
        assert alone.tokens[0] == together.tokens[i] and alone.logprobs[0] == together.logprobs[i], row.params
    reference = torch.log_softmax(logits.float(), -1)
    for prompt, scored in zip(prompts, together.prompt_logprobs, strict=True):
        assert abs(scored.logprob - reference[prompt.logits_row, prompt.target].item()) < 1e-6
        assert [t for t, _ in scored.top] == reference[prompt.logits_row].topk(prompt.k).indices.tolist()
    for row, tokens, lp in zip(rows, together.tokens, together.logprobs, strict=True):
        if row.params.temperature == 0.0 and not row.params.penalized:
            assert tokens == int(logits[row.logits_row].argmax())
        if row.params.logprobs is not None:
            assert lp.token == tokens and len(lp.top) == row.params.logprobs
            assert abs(lp.logprob - reference[row.logits_row, tokens].item()) < 1e-6


def test_sampled_draws_follow_the_distribution():
    """Inverse-CDF draws with uniform u pick the token whose cumulative mass first exceeds u (most likely first for
    top_p < 1): over a grid of u the counts match the probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0] + [-1e4] * (VOCAB - 5)])
    probs = torch.softmax(logits[0], -1)
    grid = [(i + 0.5) / 1000 for i in range(1000)]
    plain = [SampleRow(0, SamplingParams(temperature=1.0), (1,), (), frozenset(), u) for u in grid]
    drawn = sample_step(logits, SamplingBatch.make(plain, [], VOCAB, "cpu")).tokens
    for token in range(4):
        assert abs(drawn.count(token) / 1000 - probs[token].item()) < 2e-3
    nucleus = [SampleRow(0, SamplingParams(temperature=1.0, top_p=0.8), (1,), (), frozenset(), u) for u in grid]
    kept = sample_step(logits, SamplingBatch.make(nucleus, [], VOCAB, "cpu")).tokens
    assert set(kept) == {0, 1}  # 0.665 + 0.245 >= 0.8: the nucleus is the two most likely
    assert abs(kept.count(0) / 1000 - probs[0].item() / probs[:2].sum().item()) < 2e-3


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param and param in str(err.value)


def test_engine_penalties_match_hf_generate_in_a_mixed_batch(written, make_engine):
    """Greedy with every option, beside plain requests in the same steps: the tokens HF generate picks with the same
    processors, on the PEFT model of each row's adapter."""
    engine, manager = make_engine(max_slots=3, max_batch=8, token_budget=24)
    cases = [
        (p, [4, 60, 4, 33, 4, 17], name)
        for p, name in zip(OPTIONS, ["qv", None, "all_rslora", "patterns", "qv", None, "mlp_subset"], strict=True)
    ]
    plain = [engine.submit([9, 9, 40, 2], "qv", SamplingParams(max_tokens=NEW)) for _ in range(2)]
    handles = [engine.submit(prompt, name, params) for params, prompt, name in cases]
    engine.run_until_idle(max_steps=300)
    for handle, (params, prompt, name) in zip(handles, cases, strict=True):
        hf = written[name][1]
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            out = hf.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
                logits_processor=hf_processors(params, len(prompt)),
            )[0, len(prompt) :].tolist()
        stops = [i for i, t in enumerate(out) if t in params.stop_ids]
        want = out[: stops[0] + 1] if stops else out
        assert handle.result(timeout=0) == want, params
        assert len(want) >= params.min_tokens
    assert all(len(h.result(timeout=0)) == NEW for h in plain)
    manager.close()


def test_engine_logprobs_equal_log_softmax_of_the_peft_logits(written, make_engine):
    """Top-k and chosen-token logprobs of generated tokens, and prompt logprobs (echo) over a chunked prefill, for
    adapter and base rows in one batch; a prompt-only request (max_tokens 0) scores its prompt and ends."""
    engine, manager = make_engine(max_slots=3, max_batch=8, token_budget=12)
    prompt = [4, 60, 4, 33, 4, 17, 4, 9, 12, 30, 31, 32, 33, 34, 5, 6, 7, 8]  # 18 tokens: chunked by the budget of 12
    requests = [
        ("qv", SamplingParams(max_tokens=6, logprobs=5, prompt_logprobs=5)),
        (None, SamplingParams(max_tokens=6, logprobs=0)),
        ("all_rslora", SamplingParams(max_tokens=6, logprobs=3, temperature=0.8, seed=3)),
        ("patterns", SamplingParams(max_tokens=0, prompt_logprobs=2)),
        ("qv", SamplingParams(max_tokens=6)),
    ]
    handles = [engine.submit(prompt, name, params) for name, params in requests]
    engine.run_until_idle(max_steps=200)
    for handle, (name, params) in zip(handles, requests, strict=True):
        output = handle.result(timeout=0)
        assert len(output) == params.max_tokens
        reference = torch.log_softmax(oracle_logits(written, name, prompt + output), -1)  # [len, V]
        if params.logprobs is None:
            assert handle.logprobs == []
        else:
            assert [lp.token for lp in handle.logprobs] == output
            for j, lp in enumerate(handle.logprobs):
                _check(lp, reference[len(prompt) + j - 1], params.logprobs)
        if params.prompt_logprobs is None:
            assert handle.prompt_logprobs == []
            continue
        scored = handle.prompt_logprobs
        assert len(scored) == len(prompt) and scored[0] is None
        for i in range(1, len(prompt)):
            assert scored[i].token == prompt[i]
            _check(scored[i], reference[i - 1], params.prompt_logprobs)
    assert handles[3].finish_reason == "length"
    manager.close()


def _check(lp, reference: torch.Tensor, k: int) -> None:
    assert abs(lp.logprob - reference[lp.token].item()) < FP32_TOL
    values, ids = reference.topk(k)
    assert [t for t, _ in lp.top] == ids.tolist()
    assert max((abs(v - w) for (_, v), w in zip(lp.top, values.tolist(), strict=True)), default=0.0) < FP32_TOL


def test_options_give_the_same_tokens_alone_and_in_a_mixed_batch(make_engine):
    params = [
        SamplingParams(max_tokens=6, temperature=1.1, top_p=0.9, seed=5, frequency_penalty=0.7, logprobs=2),
        SamplingParams(max_tokens=6, repetition_penalty=1.4, logit_bias={3: 3.0}),
        SamplingParams(max_tokens=6, temperature=0.7, seed=9, presence_penalty=1.0, min_tokens=6, stop_ids=(5,)),
    ]
    prompt = [3, 1, 4, 1, 5]
    alone = []
    for p in params:
        engine, manager = make_engine(max_batch=8, token_budget=32)
        handle = engine.submit(prompt, "qv", p)
        engine.run_until_idle(max_steps=50)
        alone.append((handle.result(timeout=0), handle.logprobs))
        manager.close()
    engine, manager = make_engine(max_batch=8, token_budget=32)
    noise = [
        engine.submit([7, 1], name, SamplingParams(max_tokens=6, temperature=1.0, seed=1))
        for name in ("qv", None, "patterns")
    ]
    handles = [engine.submit(prompt, "qv", p) for p in params]
    engine.run_until_idle(max_steps=100)
    for handle, (tokens, logprobs) in zip(handles, alone, strict=True):
        assert handle.result(timeout=0) == tokens
        for mixed, solo in zip(handle.logprobs, logprobs, strict=True):
            assert mixed.token == solo.token and abs(mixed.logprob - solo.logprob) < 1e-5
    assert all(h.done for h in noise)
    manager.close()


def test_out_of_vocab_option_ids_are_refused_at_submit(make_engine):
    engine, manager = make_engine()
    with pytest.raises(ValueError, match="logit_bias"):
        engine.submit([1, 2], None, SamplingParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="stop_ids"):
        engine.submit([1, 2], None, SamplingParams(stop_ids=(VOCAB + 3,)))
    manager.close()


def test_top_p_from_the_candidates_picks_what_the_full_sort_picks():
    """CPU top-p draws sort only the NUCLEUS_CANDIDATES most likely tokens where they hold the nucleus: peaked rows
    (a nucleus of a few tokens), flat rows (most of the vocabulary: the full sort) and both in one batch must pick
    exactly the token the full sort picks, for every uniform."""
    from adapter_manager.runtime.engine.sampling import NUCLEUS_CANDIDATES

    vocab = 32000
    assert vocab > NUCLEUS_CANDIDATES
    gen = torch.Generator().manual_seed(3)
    peaked, flat = torch.randn(6, vocab, generator=gen) * 6, torch.randn(6, vocab, generator=gen) * 0.5

    def full_sort(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
        probs = torch.softmax(logits.float() / params.temperature, -1)
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, -1) - sorted_probs < params.top_p
        cdf = torch.cumsum(sorted_probs * keep, -1)
        pick = min(int(torch.searchsorted(cdf, u * cdf[-1:], right=True)), int(keep.sum()) - 1)
        return int(order[pick])

    for logits in (peaked, flat, torch.cat([peaked[:3], flat[:3]])):
        params = [SamplingParams(temperature=0.7 + 0.1 * i, top_p=(0.5, 0.9, 0.97)[i % 3]) for i in range(6)]
        for draw in range(4):
            rows = [
                SampleRow(i, p, (1,), (), frozenset(), uniform=random.Random(100 * draw + i).random())
                for i, p in enumerate(params)
            ]
            got = sample_step(logits, SamplingBatch.make(rows, [], vocab, "cpu")).tokens
            assert got == [full_sort(logits[r.logits_row], r.params, r.uniform) for r in rows]
