"""Which logits rows a step asks the model for, what the sampler draws or scores from each of them, and how that is
recorded into the step's requests."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from ..model.batch import ForwardBatch
from .request import Request
from .sampling import PromptRow, SampleRow, SamplingBatch, StepSample
from .scheduler import ScheduledChunk


def plan_sampling(
    chunks: Sequence[ScheduledChunk],
    batch: ForwardBatch,
    vocab: int,
    device: torch.device | str,
    pad_logits: int | None = None,
) -> tuple[ForwardBatch, SamplingBatch, list[bool]]:
    """The step's sampling inputs, built before the forward: each chunk's last token draws once its prompt is in
    (unless max_tokens is 0); every token of a prefill chunk whose request asked for ``prompt_logprobs`` scores the
    next prompt token. Only such chunks widen the logits beyond one row per chunk: ``batch`` comes back with that
    ``logits_index`` (padded with 0 to ``pad_logits`` rows on a traced device), else unchanged.

    Returns (batch, sampling batch, per chunk whether it draws a token).
    """
    samples, prompts, draws, index = [], [], [], []
    flat = 0
    for chunk in chunks:
        request, params = chunk.request, chunk.request.params
        prefill = request.in_prefill
        done = not prefill or request.prefilled + chunk.count == len(request.context)
        draws.append(done and params.max_tokens > 0)
        if prefill and params.prompt_logprobs is not None and not request.resumed:  # resumed: scored before
            for i in range(min(request.prefilled + chunk.count, len(request.prompt) - 1) - request.prefilled):
                at = request.prefilled + i  # this position's logits score prompt token at + 1
                prompts.append(PromptRow(len(index) + i, request.prompt[at + 1], params.prompt_logprobs))
            index.extend(range(flat, flat + chunk.count))
        else:
            index.append(flat + chunk.count - 1)
        if draws[-1]:
            uniform = 0.0 if request.generator is None else float(torch.rand((), generator=request.generator))
            history = (*request.prompt, *request.output) if params.penalized else ()
            samples.append(SampleRow(len(index) - 1, params, history, request.output, request.stop_ids, uniform))
        flat += chunk.count
    if len(index) > len(chunks):
        rows = len(index) if pad_logits is None else pad_logits
        logits_index = torch.tensor(index + [0] * (rows - len(index)), dtype=torch.long)
        batch = dataclasses.replace(batch, logits_index=logits_index.to(batch.tokens.device))
    return batch, SamplingBatch.make(samples, prompts, vocab, device), draws


def record_sampling(
    chunks: Sequence[ScheduledChunk], draws: Sequence[bool], result: StepSample
) -> list[tuple[Request, str]]:
    """After the forward: move each prefill chunk's request on by the chunk, append its scored prompt tokens (with
    ``prompt_logprobs``: None first, for the prompt's first token, which nothing predicts) and emit the token each
    drawing chunk drew. ``draws`` and ``result`` are what `plan_sampling` and `sample_step` made for ``chunks``.

    Returns the requests that ended in this step, with why: "stop" (a stop id drawn) or "length" (max_tokens).
    """
    finished = []
    drawn = iter(zip(result.tokens, result.logprobs, strict=True))
    scored = iter(result.prompt_logprobs)
    for chunk, draws_token in zip(chunks, draws, strict=True):
        request = chunk.request
        if request.in_prefill:
            if request.params.prompt_logprobs is not None and not request.resumed:
                first = request.prefilled
                request.prompt_logprobs.extend([None] if first == 0 else [])
                targets = min(first + chunk.count, len(request.prompt) - 1) - first
                request.prompt_logprobs.extend(itertools.islice(scored, targets))
            request.prefilled += chunk.count
            if request.in_prefill:
                continue
            if not draws_token:  # max_tokens 0: the prompt is scored, nothing generated
                finished.append((request, "length"))
                continue
        token, logprobs = next(drawn)
        request.emit(token, logprobs)
        if token in request.stop_ids:
            finished.append((request, "stop"))
        elif len(request.output) >= request.params.max_tokens:
            finished.append((request, "length"))
    return finished
