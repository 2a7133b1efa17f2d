"""A generation request's state in the engine, and the handle a caller streams its tokens from."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, SamplingParamsError, TokenLogprobs

_DONE = object()


class RequestFailedError(RuntimeError):
    """The request failed alone (its adapter could not be loaded, was unregistered, ...); others go on."""

    def __init__(self, request_id: int, cause: BaseException) -> None:
        super().__init__(f"request {request_id} failed: {cause}")
        self.request_id = request_id
        self.cause = cause


def checked_prompt(prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_seq_len: int) -> tuple[int, ...]:
    """The prompt as a tuple of ints if the request can be served, else `SamplingParamsError` (a ValueError) naming
    the offending field: ``prompt`` (empty, too long with max_tokens, token ids outside the vocabulary),
    ``logit_bias`` or ``stop_ids`` (token ids outside the vocabulary)."""
    prompt = tuple(int(t) for t in prompt)
    if not prompt:
        raise SamplingParamsError("prompt", "the prompt must hold at least one token")
    if len(prompt) + params.max_tokens > max_seq_len:
        raise SamplingParamsError(
            "prompt",
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len {max_seq_len}",
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise SamplingParamsError(
            "prompt", f"token ids must lie in [0, {vocab_size}), got [{min(prompt)}, {max(prompt)}]"
        )
    for param, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_ids", params.stop_ids)):
        outside = sorted(t for t in ids if t >= vocab_size)
        if outside:
            raise SamplingParamsError(param, f"{param} token ids must lie in [0, {vocab_size}), got {outside}")
    return prompt


@dataclass(eq=False)
class Request:
    """One sequence being served: its prompt, adapter, sampling state, KV cache row and output so far."""

    request_id: int
    prompt: tuple[int, ...]
    adapter_id: str | None  # None = the base model
    params: SamplingParams
    arrival_step: int  # engine step at which it was submitted
    generator: torch.Generator | None = None  # seeded sampler (None when greedy)
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: params.stop_ids plus the eos ids unless ignore_eos
    prefilled: int = 0  # tokens of `context` already in the KV cache
    resumed: tuple[int, ...] = ()  # output tokens at its last preemption: recomputed after the prompt
    blocks: list[int] = field(default_factory=list)  # its KV blocks in order (its block table) while running
    named: int = 0  # its leading blocks the prefix cache names (or found cached)
    namespace: bytes = b""  # its prefix-cache namespace while running (adapter and content, or the base model)
    content: str | None = None  # the content digest its adapter's slot held at its first step: its tokens' source
    cached_tokens: int = 0  # prompt tokens its last admission found in the prefix cache
    last_name: bytes = b""  # the prefix-cache name of its last named block
    context_names: tuple[bytes, tuple[bytes, ...]] = (b"", ())  # (namespace, names of its context's usable blocks)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # params.prompt_logprobs: [None, ..]
    first_token_at: float | None = None  # time.perf_counter() when the first output token was emitted
    submitted_at: float = field(default_factory=time.perf_counter)  # when `Engine.submit` queued it
    adapter_ready_at: float | None = None  # perf_counter() when a step first found its adapter ready (placeable)
    finish_reason: str | None = None  # "length", "stop", "cancelled" or "error"
    error: BaseException | None = None
    _events: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)  # set by the caller

    @property
    def context(self) -> tuple[int, ...]:
        """What a prefill computes: the prompt, and after a preemption the output it had then."""
        return self.prompt + self.resumed

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt) + len(self.resumed)

    @property
    def position(self) -> int:
        """Tokens of this sequence in the KV cache (= the position of its next token)."""
        return self.prefilled if self.in_prefill else len(self.prompt) + len(self.output) - 1

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token of the sequence so far: the prompt, then the output (its KV holds the first `position`)."""
        return self.prompt + tuple(self.output)

    def emit(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        if not self.output:
            self.first_token_at = time.perf_counter()
        self.output.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        self._events.put(token)  # after the appends: a streamed token's logprobs are there

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self._events.put(_DONE)
        self._finished.set()


class RequestHandle:
    """What `Engine.submit` returns: stream tokens as they are produced, or wait for the whole result. Its properties
    may be read from any thread while the engine steps: each is one read of state the engine sets once or appends to
    (``first_token_at`` is set before the first token counts in ``num_tokens``)."""

    def __init__(self, request: Request) -> None:
        self._request = request

    @property
    def request_id(self) -> int:
        return self._request.request_id

    @property
    def done(self) -> bool:
        return self._request._finished.is_set()

    @property
    def finish_reason(self) -> str | None:
        return self._request.finish_reason

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end the request when sampled: its ``stop_ids`` and, unless ``ignore_eos``, the eos ids. Such a
        token is the last one and has no text (vLLM's detokenizer skips the token that stopped a sequence)."""
        return self._request.stop_ids

    @property
    def first_token_at(self) -> float | None:
        """`time.perf_counter()` when the first output token was produced; None before, and for a request that ends
        without one. Time to first token: this minus the caller's own perf_counter() at submit."""
        return self._request.first_token_at

    @property
    def adapter_wait_s(self) -> float | None:
        """Seconds from submit until a step first found its adapter ready (resident, or prepared on the host);
        None until then and for a base-model request."""
        ready = self._request.adapter_ready_at
        return None if ready is None else ready - self._request.submitted_at

    @property
    def num_tokens(self) -> int:
        """Output tokens produced so far (all of them once done); never fewer than the tokens streamed."""
        return len(self._request.output)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """Logprobs of the tokens streamed so far (all of them once done) when the params ask for ``logprobs``."""
        return list(self._request.logprobs)

    def token_logprobs(self, index: int) -> TokenLogprobs | None:
        """The logprobs of output token ``index`` once it was streamed (None without ``logprobs``)."""
        logprobs = self._request.logprobs
        return logprobs[index] if index < len(logprobs) else None

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs | None]:
        """With ``prompt_logprobs``: one entry per prompt token (None for the first, which nothing predicts);
        complete once the first token is streamed or the request is done."""
        return list(self._request.prompt_logprobs)

    def cancel(self) -> None:
        """Ask the engine to drop the request (a client went away); it ends at the next step with finish_reason
        "cancelled", its KV cache row and batch place freed. No-op once done."""
        self._request.cancelled.set()

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Yield token ids as the engine produces them; raises `RequestFailedError` if the request fails."""
        while True:
            item = self._request._events.get(timeout=timeout)
            if item is _DONE:
                if self._request.error is not None:
                    raise RequestFailedError(self.request_id, self._request.error)
                return
            yield item

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated token ids once the request is done; raises `RequestFailedError` if it failed."""
        if not self._request._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not done after {timeout}s")
        if self._request.error is not None:
            raise RequestFailedError(self.request_id, self._request.error)
        return list(self._request.output)
