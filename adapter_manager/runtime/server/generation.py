"""One HTTP generation request on the engine, seen from the event loop: admission against a bounded number of
in-flight requests, tokens awaited without blocking the loop, and token ids turned into text deltas with stop
strings applied."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..engine.engine import Engine
from ..engine.request import RequestHandle, checked_prompt
from ..engine.sampling import SamplingParams, TokenLogprobs
from ..model.tokenizer import Tokenizer

_END = object()


class OverloadedError(RuntimeError):
    """Too many requests in flight; the client should retry later (HTTP 503)."""


@dataclass(frozen=True)
class Completion:
    """The finished text of one choice."""

    text: str
    finish_reason: str  # "stop" or "length"
    completion_tokens: int
    logprobs: list[TokenLogprobs]  # of the tokens read (through the one completing a stop string), if asked for


class TextDecoder:
    """Token ids -> text deltas. Decodes the whole output each time (outputs are short) so multi-byte characters
    split across tokens come out whole; holds back a possible stop-string prefix until it is decided. Stop strings
    count only from the ``min_tokens``-th token on (as vLLM's min_tokens). Every other token is the tokenizer's
    decode with ``skip_special_tokens``, as transformers and vLLM give it, except the ``hidden`` ids: the request's
    stop ids (its ``stop_token_ids``, and its eos ids unless ``ignore_eos``), one of which can only be its last token,
    the one that stopped it, which vLLM does not detokenize either. With ``ignore_eos`` an eos id that is not a special
    token of the tokenizer is text."""

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), min_tokens: int = 0, hidden: frozenset[int] = frozenset()
    ) -> None:
        self._tokenizer = tokenizer
        self._hidden = hidden
        self._stop = tuple(stop)
        self._min_tokens = min_tokens
        self._search_from = 0  # stop strings start at or after this character
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._sent = 0
        self.stopped = False  # a stop string was found; the text ends before it
        self.tokens = 0

    def add(self, token: int) -> str:
        """The new text made final by `token` ('' if none yet)."""
        self.tokens += 1
        if token not in self._hidden:
            self._ids.append(token)
        text = self._tokenizer.decode(self._ids)
        if self.tokens < self._min_tokens:
            self._search_from = len(text)
        for stop in self._stop if self.tokens >= self._min_tokens else ():
            at = text.find(stop, self._search_from)
            if at >= 0:
                self.stopped = True
                return self._emit(text[:at])
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its next token
            return ""
        return self._emit(text[: max(len(text) - self._hold, self._sent)])

    def flush(self) -> str:
        """The held-back rest once generation has ended without a stop string."""
        return "" if self.stopped else self._emit(self._tokenizer.decode(self._ids))

    def _emit(self, text: str) -> str:
        delta, self._sent = text[self._sent :], max(self._sent, len(text))
        return delta


class Generator:
    """Submits to the engine from the event loop; at most `max_pending` requests in flight."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_pending: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._waiters = ThreadPoolExecutor(max_workers=max_pending, thread_name_prefix="await-tokens")
        self._drain = ThreadPoolExecutor(max_workers=4, thread_name_prefix="await-end")

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    @contextlib.asynccontextmanager
    async def run(
        self, requests: Sequence[tuple[list[int], SamplingParams]], adapter_id: str | None
    ) -> AsyncIterator[list[RequestHandle]]:
        """Queue the (prompt, params) requests, all or none, for the body of the `async with`: raises `OverloadedError`
        when they would exceed `max_pending`, and the engine's errors (unknown adapter, prompt too long) before
        anything is queued. Requests still running when the body exits (stop string, client gone) are cancelled;
        they count as in flight until the engine has dropped them."""
        vocab_size, max_seq_len = self.engine.model.config.vocab_size, self.engine.config.max_seq_len
        for prompt, params in requests:  # one that can never run is refused as such (400), not as an overload (503)
            checked_prompt(prompt, params, vocab_size, max_seq_len)
        with self._lock:
            if self._pending + len(requests) > self.max_pending:
                raise OverloadedError(
                    f"{self._pending} requests in flight, the server's limit is {self.max_pending}; retry later"
                )
            self._pending += len(requests)
        handles: list[RequestHandle] = []
        try:
            for prompt, params in requests:
                handles.append(self.engine.submit(prompt, adapter_id, params))
            yield handles
        finally:
            self._done(len(requests) - len(handles))
            for handle in handles:
                if handle.done:
                    self._done(1)
                else:  # stopped early (stop string, client gone): the engine drops it at its next step
                    handle.cancel()
                    self._drain.submit(self._await_end, handle)

    async def tokens(self, handle: RequestHandle) -> AsyncIterator[tuple[int, TokenLogprobs | None]]:
        """The request's token ids, each with its logprobs (None unless asked for), as the engine produces them;
        raises `RequestFailedError` if it fails."""
        loop = asyncio.get_running_loop()
        stream = handle.stream()
        for index in itertools.count():
            token = await loop.run_in_executor(self._waiters, next, stream, _END)
            if token is _END:
                return
            yield token, handle.token_logprobs(index)

    async def complete(self, handle: RequestHandle, stop: Sequence[str], min_tokens: int = 0) -> Completion:
        decoder = self.decoder(handle, stop, min_tokens)
        text, logprobs = [], []
        async for token, token_logprobs in self.tokens(handle):
            text.append(decoder.add(token))
            if token_logprobs is not None:
                logprobs.append(token_logprobs)
            if decoder.stopped:
                break
        text.append(decoder.flush())
        return Completion("".join(text), finish_reason(handle, decoder), decoder.tokens, logprobs)

    def decoder(self, handle: RequestHandle, stop: Sequence[str] = (), min_tokens: int = 0) -> TextDecoder:
        """A :class:`TextDecoder` for one choice: the token that stopped it (a stop id, or an eos id unless
        ``ignore_eos``) is no text."""
        return TextDecoder(self.tokenizer, stop, min_tokens, handle.stop_ids)

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
        self._drain.shutdown(wait=False, cancel_futures=True)

    def _await_end(self, handle: RequestHandle) -> None:
        try:
            handle.result()
        except Exception:  # noqa: BLE001 - its failure was (or would have been) reported to its client
            pass
        finally:
            self._done(1)

    def _done(self, count: int) -> None:
        with self._lock:
            self._pending -= count


def finish_reason(handle: RequestHandle, decoder: TextDecoder) -> str:
    """OpenAI's finish reason: "stop" for a stop string or the end-of-sequence token, "length" at max_tokens."""
    return "stop" if decoder.stopped or handle.finish_reason == "stop" else "length"
