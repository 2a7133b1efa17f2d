"""The HTTP server: an OpenAI-compatible API over the engine, the adapter admin API, metrics and health.

    app = create_app(engine, manager, tokenizer, ServerConfig(model_name="my-llama", port=0))
    with BackgroundServer(app) as server:           # or serve(app): in the foreground, until Ctrl-C
        OpenAI(base_url=server.url + "/v1", api_key="-").completions.create(model="org/adapter", prompt="Hi")

Routes: see `openai_routes` (completions, chat, models) and `admin_routes` (adapters, vLLM load/unload), plus
``GET /metrics`` (Prometheus text), ``GET /v1/metrics/swaps`` (the manager's JSON snapshot with hit rates, and the
engine's KV blocks and prefix cache under ``kv``) and
``GET /health``; ``POST /debug/heap`` only with ``ADAPTER_MANAGER_HEAP_PROFILE`` set (`heap_profile`). Bodies
larger than ``max_body_bytes`` get 413 before any route reads them.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from adapter_manager import AdapterManager
from adapter_manager.prometheus import AdapterManagerCollector

from ..engine.engine import Engine
from ..model.tokenizer import Tokenizer
from .admin_routes import admin_router
from .heap_profile import HeapProfiler, heap_router
from .heap_trim import HeapTrimmer
from .http_errors import error_body, install_handlers
from .kv_collector import KVCacheCollector
from .openai_routes import openai_router
from .state import ServerConfig, ServerState

log = logging.getLogger(__name__)

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]


def create_app(engine: Engine, manager: AdapterManager, tokenizer: Tokenizer, config: ServerConfig) -> FastAPI:
    """The ASGI app. It does not start the engine: `serve` / `BackgroundServer` do (or call `engine.start()`)."""
    state = ServerState(engine, manager, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        trimmer = HeapTrimmer().start()  # while serving, the C heap's free pages go back to the system
        yield
        trimmer.stop()
        state.close()

    app = FastAPI(title="adapter-manager", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_handlers(app)
    app.include_router(openai_router(state))
    app.include_router(admin_router(state))
    if (profiler := HeapProfiler.from_env()) is not None:  # ADAPTER_MANAGER_HEAP_PROFILE: off by default
        profiler.start()
        app.include_router(heap_router(profiler, state.check_admin))

    registry = CollectorRegistry()
    registry.register(AdapterManagerCollector(manager))
    registry.register(KVCacheCollector(engine))
    served = Counter(
        "adapter_manager_http_requests", "HTTP requests by route and status", ["route", "status"], registry=registry
    )
    in_flight = Gauge("adapter_manager_generation_in_flight", "Generation requests in flight", registry=registry)
    in_flight.set_function(lambda: state.generator.pending)

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        served.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)

    @app.get("/health")
    def health() -> dict:
        return {
            "status": "ok",
            "model": config.model_name,
            "adapters": len(manager.records()),
            "slots": manager.num_slots,
            "in_flight": state.generator.pending,
        }

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/metrics/swaps")
    def swaps() -> dict:
        snapshot = manager.metrics().to_dict()
        hits, misses = snapshot["hits"], snapshot["misses"]
        snapshot["hit_rates"] = {
            tier: hits.get(tier, 0) / total
            for tier in sorted(set(hits) | set(misses))
            if (total := hits.get(tier, 0) + misses.get(tier, 0))
        }
        snapshot["kv"] = engine.kv_metrics().to_dict()  # KV blocks and the prefix cache
        return snapshot

    return app


class _BodyLimit:
    """Reads the whole body first (bounded), so a route never sees more than `max_bytes`; over it: 413."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: _Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks, size, more = [], 0, not too_big
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            too_big = size > self.max_bytes
            if too_big:
                break
        if too_big:
            await _send_json(send, 413, error_body(413, f"request body exceeds {self.max_bytes} bytes"))
            return
        body, replayed = b"".join(chunks), False

        async def replay() -> _Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_json(send: Callable, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _bind(config: ServerConfig) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn(app: FastAPI) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))


def serve(app: FastAPI, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve `create_app`'s app in the calling thread until SIGINT/SIGTERM; starts its engine first, stops it last."""
    engine, config = app.state.server.engine, app.state.server.config
    sock = _bind(config)
    url = f"http://{config.host}:{sock.getsockname()[1]}"
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # uvicorn re-raises the signal after its graceful shutdown
    engine.start()
    try:
        if on_ready is not None:
            on_ready(url)
        _uvicorn(app).run(sockets=[sock])
    except KeyboardInterrupt:
        log.info("interrupted; the server at %s stopped", url)
    finally:
        engine.stop()
        sock.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class BackgroundServer:
    """The server on a background thread (tests, the demo): `start()` returns once it accepts connections."""

    def __init__(self, app: FastAPI) -> None:
        self._app, self._engine, self._config = app, app.state.server.engine, app.state.server.config
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        sock = _bind(self._config)
        self.url = f"http://{self._config.host}:{sock.getsockname()[1]}"
        self._engine.start()
        self._server = _uvicorn(self._app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server at {self.url} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._engine.stop()

    def __enter__(self) -> BackgroundServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
