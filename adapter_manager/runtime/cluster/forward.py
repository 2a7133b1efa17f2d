"""An HTTP request carried from the ingress to a replica, and the replica's answer as a stream of parts: the
replica runs it through the single-machine server's own ASGI app, in process, so the cluster serves exactly the
routes, validation, streaming and error bodies of `runtime.server`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

_END = object()


@dataclass(frozen=True)
class ForwardedRequest:
    """What the replica's app needs of the client's request."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    adapter_id: str = ""  # the adapter the body names ("" = none or the base model)


@dataclass(frozen=True)
class ResponseStart:
    """The first part of every answer; body chunks (bytes) follow."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def call_app(app: Callable, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through the ASGI `app`; yields its `ResponseStart`, then its body chunks as they are sent.
    Closing the iterator early (the client left) tells the app the client disconnected and cancels it."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query,
        "headers": list(request.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(_END))
    complete = False
    try:
        while not complete:
            message = await messages.get()
            if message is _END:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((k, v) for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                complete = not message.get("more_body", False)
        await task  # the answer is whole: let the app finish its own clean-up
    finally:
        gone.set()
        if not task.done():
            task.cancel()
