"""Sampling parameters, and the step's batched sampler: logit bias, min_tokens, repetition / frequency / presence
penalties, greedy or temperature + top-p draws, and log-probabilities (top-k, of the chosen token, of the prompt).

Every request of a step is sampled by one set of batched tensor ops over the rows that use an option; a row's
result depends only on its own logits and options, never on the other rows of the step. The per-row inputs are small
tensors built on the host before the forward (`SamplingBatch.make`); after it, `sample_step` costs one host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from adapter_manager.kernels import platform_for

MAX_LOGPROBS = 20  # top-k alternatives a request may ask for (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| bound, as OpenAI's


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``param`` names it (an HTTP server reports it as the bad field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen, what it reports, and when it stops."""

    max_tokens: int = 16  # tokens to generate at most; 0 = score the prompt only (with prompt_logprobs)
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept when sampling
    seed: int | None = None  # sampling seed; the same seed, prompt and adapter give the same tokens
    stop_ids: tuple[int, ...] = ()  # token ids that end the request beside the model's eos ids (the stop is returned)
    ignore_eos: bool = False  # keep generating past the model's end-of-sequence ids (vLLM's ignore_eos)
    logprobs: int | None = None  # report each generated token's logprob and its top-k alternatives (0: none)
    prompt_logprobs: int | None = None  # report each prompt token's logprob (the first has none) and top-k
    presence_penalty: float = 0.0  # OpenAI: logit -= presence * (token occurs in the output so far)
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency * (occurrences in the output so far)
    repetition_penalty: float = 1.0  # vLLM / HF (CTRL): a token seen in prompt or output: logit / p if > 0 else * p
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()  # token id -> added to its logit
    min_tokens: int = 0  # the stop and eos ids are masked until this many tokens are generated

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(param, message)

        def real(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def count(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 0

        check(count(self.max_tokens), "max_tokens", f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        check(
            self.max_tokens > 0 or self.prompt_logprobs is not None,
            "max_tokens",
            "max_tokens 0 (score the prompt only) needs prompt_logprobs",
        )
        check(
            real(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            f"temperature must be in [0, 100], got {self.temperature!r}",
        )
        check(real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (count(value) and value <= MAX_LOGPROBS),
                name,
                f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(real(value) and -2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value!r}")
        check(
            real(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be > 0 (1 = none), got {self.repetition_penalty!r}",
        )
        check(count(self.min_tokens), "min_tokens", f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs = []
        for token, value in bias:
            check(count(token), "logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
            check(
                real(value) and abs(value) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} for {token}",
            )
            pairs.append((int(token), float(value)))
        object.__setattr__(self, "logit_bias", tuple(sorted(dict(pairs).items())))
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))

    @property
    def penalized(self) -> bool:
        """Whether any option changes the logits before the draw (bias, min_tokens, penalties)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability under the model (raw logits, before bias, penalties and temperature, as vLLM's
    default) and the ``k`` most likely tokens at its position, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), k of them


@dataclass(frozen=True)
class SampleRow:
    """What the sampler needs from one request that draws a token this step."""

    logits_row: int  # its row of the step's logits
    params: SamplingParams
    history: Sequence[int]  # prompt + output so far (the repetition penalty's tokens)
    generated: Sequence[int]  # output so far (frequency / presence penalties, min_tokens)
    stop_ids: frozenset[int]  # masked while fewer than min_tokens are generated
    uniform: float = 0.0  # its draw in [0, 1) from its own generator (unused when greedy)


@dataclass(frozen=True)
class PromptRow:
    """One prompt position whose next prompt token is scored: logits row -> target token, with top-k."""

    logits_row: int
    target: int
    k: int


@dataclass(frozen=True)
class StepSample:
    """What `sample_step` returns, in the order of the rows it was given."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per sample row: None unless its params ask for logprobs
    prompt_logprobs: list[TokenLogprobs]  # per prompt row


@dataclass(frozen=True)
class SamplingBatch:
    """The step's sampling inputs as small tensors, built on the host before the forward and moved whole; the
    index tensors pick rows out of the n sample rows (None when no row is in that group).

    Worked example: r0 greedy; r1 at temperature 0.8, frequency_penalty 0.5, outputs so far [7, 7]; vocab V:
      rows [row(r0), row(r1)]   temperature [0.0, 0.8]   plain [1]   nucleus None   penalized [1]
      frequency [[0.5]]   repetition [[1.0]]   history [[*prompt(r1), 7, 7]]   outputs [[7, 7]]
    """

    rows: torch.Tensor  # [n] logits row of each sample row
    samples: tuple[SampleRow, ...]
    prompts: tuple[PromptRow, ...]
    greedy_only: bool  # no row draws: argmax only
    temperature: torch.Tensor | None  # [n, 1]; None when greedy_only
    uniform: torch.Tensor | None  # [n, 1]
    plain: torch.Tensor | None  # rows drawn with top_p == 1
    nucleus: torch.Tensor | None  # rows drawn with top_p < 1
    top_p: torch.Tensor | None  # [len(nucleus), 1]
    penalized: torch.Tensor | None  # rows with logit_bias / min_tokens / penalties: p of them
    repetition: torch.Tensor | None  # [p, 1]
    frequency: torch.Tensor | None  # [p, 1]
    presence: torch.Tensor | None  # [p, 1]
    history: torch.Tensor | None  # [p, L] prompt + output ids, padded with the row's first id
    outputs: torch.Tensor | None  # [p, Lo] output ids, padded with V
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row in p, token id, value)
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (row in p, stop id) of rows still under min_tokens
    logprob_rows: torch.Tensor | None  # rows reporting logprobs
    prompt_rows: torch.Tensor | None  # [m] logits rows of the prompt rows
    prompt_targets: torch.Tensor | None  # [m, 1]

    @classmethod
    def make(
        cls, samples: Sequence[SampleRow], prompts: Sequence[PromptRow], vocab: int, device: torch.device | str
    ) -> SamplingBatch:
        def tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        def rows_where(keep) -> torch.Tensor | None:
            picked = [i for i, row in enumerate(samples) if keep(row.params)]
            return tensor(picked) if picked else None

        def padded(seqs: list[Sequence[int]], pad: Callable[[Sequence[int]], int]) -> torch.Tensor:
            width = max(1, *(len(s) for s in seqs))
            return tensor([[*s, *([pad(s)] * (width - len(s)))] for s in seqs])

        def column(values: list[float]) -> torch.Tensor:
            return tensor([[v] for v in values], torch.float32)

        greedy_only = all(r.params.temperature == 0.0 for r in samples)
        nucleus_p = [r.params.top_p for r in samples if r.params.temperature > 0.0 and r.params.top_p < 1.0]
        pen = [r for r in samples if r.params.penalized]
        bias = [(i, t, v) for i, r in enumerate(pen) for t, v in r.params.logit_bias]
        masked = [
            (i, t)
            for i, r in enumerate(pen)
            if len(r.generated) < r.params.min_tokens
            for t in sorted(r.stop_ids)
            if t < vocab
        ]
        return cls(
            rows=tensor([r.logits_row for r in samples]),
            samples=tuple(samples),
            prompts=tuple(prompts),
            greedy_only=greedy_only,
            temperature=None if greedy_only else column([r.params.temperature for r in samples]),
            uniform=None if greedy_only else column([r.uniform for r in samples]),
            plain=rows_where(lambda p: p.temperature > 0.0 and p.top_p == 1.0),
            nucleus=rows_where(lambda p: p.temperature > 0.0 and p.top_p < 1.0),
            top_p=column(nucleus_p) if nucleus_p else None,
            penalized=rows_where(lambda p: p.penalized),
            repetition=column([r.params.repetition_penalty for r in pen]) if pen else None,
            frequency=column([r.params.frequency_penalty for r in pen]) if pen else None,
            presence=column([r.params.presence_penalty for r in pen]) if pen else None,
            history=padded([r.history for r in pen], lambda s: s[0]) if pen else None,  # repeats are harmless
            outputs=padded([r.generated for r in pen], lambda s: vocab) if pen else None,
            bias=_bias_tensors(bias, tensor) if bias else None,
            masked=(tensor([m[0] for m in masked]), tensor([m[1] for m in masked])) if masked else None,
            logprob_rows=rows_where(lambda p: p.logprobs is not None),
            prompt_rows=tensor([r.logits_row for r in prompts]) if prompts else None,
            prompt_targets=tensor([[r.target] for r in prompts]) if prompts else None,
        )


def _bias_tensors(bias: list[tuple[int, int, float]], tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, ids, values = zip(*bias, strict=True)
    return tensor(list(rows)), tensor(list(ids)), tensor(list(values), torch.float32)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Semantics (per penalized row, in vLLM's order)::

        logits[t] += logit_bias[t]
        logits[s] = -inf                       for s in stop_ids while len(output) < min_tokens
        seen = tokens of prompt + output;      logits[t in seen] = logits[t] / rp if logits[t] > 0 else logits[t] * rp
        c = counts of tokens in the output;    logits -= frequency * c;   logits -= presence * (c > 0)

    Shape: logits [p, V] fp32, the penalized rows in `batch.penalized` order; returns a new [p, V] tensor.
    """
    assert batch.history is not None and batch.outputs is not None and batch.repetition is not None
    rows, vocab = logits.shape
    logits = logits.clone()
    if batch.bias is not None:
        logits.index_put_(batch.bias[:2], batch.bias[2], accumulate=True)
    if batch.masked is not None:
        logits.index_put_(batch.masked, torch.tensor(-math.inf, device=logits.device))
    seen, rp = logits.gather(1, batch.history), batch.repetition  # [p, L]: duplicates write the same value
    logits.scatter_(1, batch.history, torch.where(seen > 0, seen / rp, seen * rp))
    ones = torch.ones_like(batch.outputs, dtype=torch.float32)
    counts = torch.zeros(rows, vocab + 1, device=logits.device).scatter_add_(1, batch.outputs, ones)[:, :vocab]
    logits = logits - batch.frequency * counts
    return logits - batch.presence * (counts > 0).float()


def sample_step(logits: torch.Tensor, batch: SamplingBatch) -> StepSample:
    """Semantics (per sample row; rows never influence each other)::

        z = apply_penalties(logits[row])                          # only rows that set an option
        greedy:  token = argmax(z)
        else:    p = softmax(z / temperature); keep the smallest top set with mass >= top_p (top_p < 1);
                 token = the first kept token (most likely first) whose cumulative mass exceeds uniform * kept mass
        logprobs: log_softmax(logits[row]) at token, and its top-k   (raw logits, as vLLM's default)
        prompt rows: log_softmax(logits[row]) at target, and its top-k

    Shape: logits [N, V] (any dtype; fp32 math) on the batch's device. One host sync for everything returned.
    """
    n, k = len(batch.samples), min(MAX_LOGPROBS, logits.shape[-1])
    parts: list[torch.Tensor] = []
    tokens = None
    if n:
        if batch.greedy_only and batch.penalized is None:  # the common path: argmax of the rows, no copy
            tokens = logits.argmax(-1).index_select(0, batch.rows)
        else:
            work = logits.index_select(0, batch.rows).float()  # [n, V]
            if batch.penalized is not None:
                penalized = apply_penalties(work.index_select(0, batch.penalized), batch)
                work = work.index_copy(0, batch.penalized, penalized)
            tokens = work.argmax(-1)  # [n]
            if not batch.greedy_only:
                tokens = _draw(work, tokens, batch)
        parts.append(tokens.double())
        if batch.logprob_rows is not None:
            chosen = tokens.index_select(0, batch.logprob_rows).unsqueeze(1)
            raw = logits.index_select(0, batch.rows.index_select(0, batch.logprob_rows)).float()
            parts.append(_logprobs(raw, chosen, k))
    if batch.prompt_rows is not None:
        rows = logits.index_select(0, batch.prompt_rows).float()
        parts.append(_logprobs(rows, batch.prompt_targets, k))
    if not parts:
        return StepSample([], [], [])
    flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the step's one host sync
    out_tokens = [int(t) for t in flat[:n]]
    at = n
    logprobs: list[TokenLogprobs | None] = [None] * n
    if batch.logprob_rows is not None:
        for row in (r for r, s in enumerate(batch.samples) if s.params.logprobs is not None):
            logprobs[row] = _unpack(flat, at, out_tokens[row], batch.samples[row].params.logprobs, k)
            at += 1 + 2 * k
    prompt_logprobs = []
    for row in batch.prompts:
        prompt_logprobs.append(_unpack(flat, at, row.target, row.k, k))
        at += 1 + 2 * k
    return StepSample(out_tokens, logprobs, prompt_logprobs)


def _draw(work: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Inverse-CDF draws for the rows that sample, each with its own uniform; greedy rows keep their argmax."""
    assert batch.temperature is not None and batch.uniform is not None
    tokens = tokens.clone()
    if batch.plain is not None:
        idx = batch.plain
        probs = torch.softmax(work.index_select(0, idx) / batch.temperature[idx], dim=-1)
        cdf = torch.cumsum(probs, dim=-1)
        total = cdf[:, -1:]
        last = (cdf < total).sum(-1, keepdim=True)  # the last token with mass: where the cdf reaches its total
        pick = torch.searchsorted(cdf, batch.uniform[idx] * total, right=True).minimum(last)
        tokens.index_copy_(0, idx, pick.squeeze(1))
    if batch.nucleus is not None:
        assert batch.top_p is not None
        idx, top_p = batch.nucleus, batch.top_p
        probs = torch.softmax(work.index_select(0, idx) / batch.temperature[idx], dim=-1)
        if platform_for(probs.device).computes_on_host and probs.shape[-1] > NUCLEUS_CANDIDATES:
            # a full sort is ~1 ms per row of 32k here: sort only the most likely candidates where they hold the
            # nucleus (a host check: free on CPU; traced and CUDA steps keep their one sync and static shapes)
            top, order = torch.topk(probs, NUCLEUS_CANDIDATES, dim=-1)  # sorted, most likely first
            held = (torch.cumsum(top, dim=-1)[:, -1:] >= top_p).squeeze(1)  # the next token would not be kept
            if bool(held.all()):
                tokens.index_copy_(0, idx, _nucleus_pick(top, order, top_p, batch.uniform[idx]))
                return tokens
            if bool(held.any()):
                rows = held.nonzero().squeeze(1)
                picks = _nucleus_pick(top[rows], order[rows], top_p[rows], batch.uniform[idx[rows]])
                tokens.index_copy_(0, idx[rows], picks)
                idx, top_p, probs = idx[~held], top_p[~held], probs[~held]
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        tokens.index_copy_(0, idx, _nucleus_pick(sorted_probs, order, top_p, batch.uniform[idx]))
    return tokens


NUCLEUS_CANDIDATES = 256
"""Tokens a CPU top-p draw sorts first (``topk``, 0.4 ms for 8 rows of 32k against 8 ms for the full sort); a row
whose nucleus is larger falls back to the full sort. The pick is the same either way: the prefix sums of the sorted
probabilities are the full sort's (torch's CPU cumsum is sequential), and every kept token is in the prefix."""


def _nucleus_pick(
    sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """The kept token whose cumulative mass first exceeds uniform × kept mass, from probabilities sorted most likely
    first (a prefix of them holding every kept token). Shape: sorted_probs, order [m, K]; top_p, uniform [m, 1];
    returns the token ids [m]."""
    keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p  # the first token is always kept
    cdf = torch.cumsum(sorted_probs * keep, dim=-1)
    last = keep.sum(-1, keepdim=True) - 1
    pick = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).minimum(last)
    return order.gather(1, pick).squeeze(1)


def _logprobs(rows: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """[r, V] fp32 logits, [r, 1] token ids -> flat [r * (1 + 2k)] fp64: logprob of the token, top-k values, ids."""
    lp = torch.log_softmax(rows, dim=-1)
    values, ids = lp.topk(k, dim=-1)
    return torch.cat([lp.gather(1, chosen), values, ids.float()], dim=1).double().flatten()


def _unpack(flat: list[float], at: int, token: int, want: int, k: int) -> TokenLogprobs:
    values, ids = flat[at + 1 : at + 1 + k], flat[at + 1 + k : at + 1 + 2 * k]
    return TokenLogprobs(token, flat[at], tuple((int(i), v) for i, v in zip(ids[:want], values[:want], strict=True)))
