"""The soak benchmark's client: one generation request and how it was answered, admin calls, malformed requests, and
an open loop that sends every request at its time while other tasks (churn, malformed requests, samplers) run.

Every request asks for its tokens' logprobs (``logprobs: 0``). Every answer is put in one class (``Answer.outcome``):
``ok`` (200, every token: ``ignore_eos`` fixes the length), ``cancelled`` (the client closed the stream after two
chunks), ``4xx`` and ``503`` (a typed OpenAI error body), ``stream_error`` (a typed error event after the stream
began), and the failures ``5xx``, ``untyped`` (an error status without an OpenAI error body), ``conn_error``, ``hang``
(no end within ``hang_s``) and ``short`` (fewer tokens)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

FAILURES = ("5xx", "untyped", "conn_error", "hang", "short")
MALFORMED = {"bad_json": 400, "unknown_adapter": 404, "prompt_too_long": 400, "negative_max_tokens": 400}
"""Each malformed request and the status it must get (with an OpenAI error body)."""


def clock() -> float:
    return time.perf_counter()


@dataclass
class Answer:
    """One generation request (``kind``: stream, plain, cancel or probe) and its answer; times are ``clock()``."""

    kind: str
    model: str
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # scheduled send time, seconds after the loop's start
    sent: float = math.nan
    done: float = math.nan
    ttft: float = math.nan  # from the scheduled send to the first token (streams)
    status: int | None = None
    outcome: str = ""
    code: str | None = None  # the error body's code (else its type)
    text: str = ""
    tokens: int = 0
    logprobs: list[float] = field(default_factory=list)  # of each generated token (the replay compares them too)

    @property
    def streamed(self) -> bool:
        return self.kind in ("stream", "cancel")

    def body(self) -> dict:
        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": self.streamed,
            "logprobs": 0,  # the chosen tokens' logprobs: two adapters' greedy tokens often agree, these do not
        }
        if self.streamed:
            body["stream_options"] = {"include_usage": True}
        return body


async def generate(session: aiohttp.ClientSession, url: str, answer: Answer, hang_s: float, start: float) -> Answer:
    """Send `answer`'s request at ``start + answer.at`` and fill in how it was answered."""
    await asyncio.sleep(max(0.0, start + answer.at - clock()))
    answer.sent = clock()
    try:
        async with asyncio.timeout(hang_s):
            async with session.post(url + "/v1/completions", json=answer.body()) as reply:
                answer.status = reply.status
                if reply.status != 200:
                    _typed_error(answer, reply.status, await reply.text())
                elif answer.streamed:
                    await _read_stream(answer, reply, start + answer.at)
                else:
                    data = await reply.json()
                    answer.text = data["choices"][0]["text"]
                    answer.logprobs = data["choices"][0]["logprobs"]["token_logprobs"]
                    answer.tokens = data["usage"]["completion_tokens"]
                    answer.outcome = "ok" if answer.tokens == answer.max_tokens else "short"
    except TimeoutError:
        answer.outcome = "hang"
    except (aiohttp.ClientError, ConnectionError) as err:
        answer.outcome, answer.code = "conn_error", type(err).__name__
    answer.done = clock()
    return answer


def _typed_error(answer: Answer, status: int, text: str) -> None:
    try:
        error = json.loads(text)["error"]
        answer.code = error.get("code") or error["type"]
    except (ValueError, KeyError, TypeError):
        answer.outcome, answer.code = "untyped", text[:80]
        return
    answer.outcome = "5xx" if status >= 500 and status != 503 else "503" if status == 503 else "4xx"


async def _read_stream(answer: Answer, reply: aiohttp.ClientResponse, scheduled: float) -> None:
    chunks, text = 0, []
    async for raw in reply.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            error = chunk["error"]
            answer.code = error.get("code") or error.get("type")
            answer.outcome = "5xx" if error.get("type") in (None, "server_error") else "stream_error"
            return
        if chunk.get("usage"):
            answer.tokens = chunk["usage"]["completion_tokens"]
        if not chunk.get("choices"):
            continue
        if chunks == 0:
            answer.ttft = clock() - scheduled
        chunks += 1
        text.append(chunk["choices"][0]["text"])
        answer.logprobs += (chunk["choices"][0].get("logprobs") or {}).get("token_logprobs", [])
        if answer.kind == "cancel" and chunks == 2:
            reply.close()  # the connection itself, as a client that goes away
            answer.outcome = "cancelled"
            return
    answer.text = "".join(text)
    answer.outcome = "ok" if answer.tokens == answer.max_tokens else "short"


@dataclass
class AdminCall:
    """One admin call: its status and JSON (or text) answer."""

    status: int
    data: dict | str

    @property
    def typed_4xx(self) -> bool:
        return 400 <= self.status < 500 and isinstance(self.data, dict) and "error" in self.data

    def field(self, key: str) -> object:
        return self.data.get(key) if isinstance(self.data, dict) else None


async def admin(
    session: aiohttp.ClientSession, url: str, method: str, path: str, body: dict | None = None
) -> AdminCall:
    async with session.request(method, url + path, json=body) as reply:
        text = await reply.text()
        try:
            data = json.loads(text)
        except ValueError:
            data = text
        return AdminCall(reply.status, data)


def identity(info: dict) -> str | None:
    """What the admin API says an adapter is: its content ``digest`` where the server reports one, else None."""
    return info.get("digest")


@dataclass
class Malformed:
    """Malformed requests sent one every ``every_s`` while the load runs; ``results``: (kind, status, typed)."""

    url: str
    base: str  # the base model's name
    max_seq_len: int
    every_s: float = 1.0
    results: list[tuple[str, int | None, bool]] = field(default_factory=list)

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        kinds = list(MALFORMED)
        while not stop.is_set():
            kind = kinds[len(self.results) % len(kinds)]
            self.results.append(await self.send(session, kind))
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass

    async def send(self, session: aiohttp.ClientSession, kind: str) -> tuple[str, int | None, bool]:
        body: dict | bytes = {"model": self.base, "prompt": [1, 2, 3], "max_tokens": 4}
        if kind == "unknown_adapter":
            body["model"] = "nobody/no-such-adapter"
        elif kind == "prompt_too_long":
            body["prompt"] = [5] * (self.max_seq_len + 8)
        elif kind == "negative_max_tokens":
            body["max_tokens"] = -3
        elif kind == "bad_json":
            body = b'{"model": "' + self.base.encode() + b'", "prompt": [1, 2'
        try:
            kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if kind == "bad_json" else {}
            async with session.post(self.url + "/v1/completions", json=None if kwargs else body, **kwargs) as reply:
                answer = Answer("malformed", "", [], 0)
                _typed_error(answer, reply.status, await reply.text())
                return kind, reply.status, reply.status == MALFORMED[kind] and answer.outcome == "4xx"
        except (aiohttp.ClientError, ConnectionError):
            return kind, None, False


Side = Callable[[aiohttp.ClientSession, asyncio.Event], Awaitable[None]]


def open_loop(url: str, answers: Sequence[Answer], hang_s: float, sides: Sequence[Side] = ()) -> float:
    """Send every answer's request at its ``at`` (an open loop: nothing waits for an earlier answer) while the
    `sides` run (each until the last answer is in); returns the span in seconds from the start to the last answer."""

    async def main() -> float:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(side(session, stop)) for side in sides]
            start = clock()
            await asyncio.gather(*(generate(session, url, a, hang_s, start) for a in answers))
            span = clock() - start
            stop.set()
            await asyncio.gather(*tasks)
            return span

    return asyncio.run(main())


def percentile_ms(values: Sequence[float], q: float) -> float | None:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return None
    rank = (len(values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(values) - 1)
    return 1000 * (values[low] + (values[high] - values[low]) * (rank - low))
