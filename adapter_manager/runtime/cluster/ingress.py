"""The cluster's HTTP front: Serve's FastAPI ingress. Generation and registration are forwarded whole to an engine
replica, whose app is the single-machine server's (`runtime.server.create_app`), so routes, validation, streaming
and error bodies are the same code; the OpenAI `model` field becomes the multiplexed model id. What only the
cluster can answer (the adapter list across replicas, deletion, operator pins, the replicas' JSON view) is answered
here.

A replica that dies under a request: a JSON answer is retried on another replica (generation is deterministic for
a prompt and seed), as is a stream that has sent nothing yet; a stream cut after its first bytes ends with an
OpenAI error event, as the single server ends a failed stream."""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations (Request) off the class Serve
# wraps, where string annotations do not resolve. Module-level helpers come before the class: Serve pickles it when
# it is decorated.
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from ..server.http_errors import APIError, error_body, install_handlers
from .config import ClusterConfig
from .forward import ForwardedRequest, ResponseStart
from .snapshots import merge_snapshots

log = logging.getLogger(__name__)

ATTEMPTS = 3  # tries of one request when its replica dies under it
KNOWN_TTL_S = 1.0  # how long the ingress trusts that an adapter is registered
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)

app = FastAPI(title="adapter-manager cluster", version="0.1.0", docs_url=None, redoc_url=None)
install_handlers(app)


async def _relay(first: bytes, parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    try:
        async for part in parts:
            yield part
    except _REPLICA_GONE as err:
        message = f"the replica serving this stream died ({type(err).__name__}); retry the request"
        yield f"data: {json.dumps(error_body(503, message, None, 'replica_died'))}\n\n".encode()
        yield b"data: [DONE]\n\n"


def _headers(start: ResponseStart) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in start.headers if k.lower() != b"content-length"}


def _response(start: ResponseStart, body: bytes) -> Response:
    media = dict(start.headers).get(b"content-type", b"application/json").decode()
    headers = {k: v for k, v in _headers(start).items() if k.lower() != "content-type"}
    return Response(body, start.status, headers, media_type=media)


def _with_body(forwarded: ForwardedRequest, body: bytes) -> ForwardedRequest:
    """`forwarded` carrying `body`, its content-length header set to match."""
    headers = tuple((k, v) for k, v in forwarded.headers if k != b"content-length")
    return dataclasses.replace(forwarded, headers=(*headers, (b"content-length", str(len(body)).encode())), body=body)


def _gone(forwarded: ForwardedRequest) -> APIError:
    return APIError(
        503, f"the replicas serving {forwarded.path} died {ATTEMPTS} times in a row; retry later", None, "replica_died"
    )


def _adapter(entry: Any, reports: dict[str, dict]) -> dict:
    """One adapter across the cluster: the validating replica's answer, and which replicas hold it now."""
    loaded = [r for r, report in reports.items() if entry.adapter_id in report["loaded"]]
    in_slot = [r for r, report in reports.items() if entry.adapter_id in report["slots"]]
    return {
        **entry.info,
        "id": entry.adapter_id,
        "object": "adapter",
        "ref": entry.ref,
        "version": entry.version,
        "pinned": entry.pinned,
        "tier": "slot" if in_slot else "disk",
        "replicas": {"loaded": loaded, "in_slot": in_slot},
    }


@serve.ingress(app)
class Ingress:
    def __init__(self, config: ClusterConfig, replicas: DeploymentHandle, directory: DeploymentHandle) -> None:
        self.config = config
        self.replicas = replicas
        self.directory = directory
        self.started_at = time.time()
        self.known: dict[str, float] = {}  # adapter id -> when the directory last confirmed it
        self.pinned: set[str] = set()  # operator-pinned (resident on every replica) as of that confirmation

    # -- generation: forwarded with the adapter as Serve's multiplexed model id --

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request)

    async def _generate(self, request: Request) -> Response:
        forwarded = await self._forwarded(request)
        try:
            body = json.loads(forwarded.body)
        except ValueError:
            body = None  # the replica's validation answers it
        model = body.get("model") if isinstance(body, dict) else None
        model_id = ""
        if isinstance(model, str) and model != self.config.server.model_name:
            if not await self._known(model):
                raise APIError(
                    404,
                    f"model {model!r} is neither the base model nor a registered adapter",
                    "model",
                    "model_not_found",
                )
            model_id = model if self.config.multiplexed and model not in self.pinned else ""  # pinned: anywhere
            forwarded = dataclasses.replace(forwarded, adapter_id=model)
        if isinstance(body, dict) and body.get("stream"):
            return await self._stream(forwarded, model_id)
        return await self._whole(forwarded, model_id)

    # -- registration: validated by one replica's admin route, then recorded once in the directory --

    @app.post("/v1/adapters")
    async def register(self, request: Request) -> Response:
        forwarded = await self._forwarded(request)
        try:
            sent = json.loads(forwarded.body)
        except ValueError:
            sent = None  # the replica's validation answers it
        pin = isinstance(sent, dict) and sent.get("pin") is True
        if pin:  # a cluster pin is the directory's (every replica), never the validating replica's own
            forwarded = _with_body(forwarded, json.dumps({**sent, "pin": False}).encode())
        response = await self._whole(forwarded, "")
        if response.status_code in (200, 201):
            info = json.loads(response.body)
            ref = f"{sent['ref']}@{sent['revision']}" if sent.get("revision") else sent["ref"]
            await self.directory.put.remote(info["id"], ref, info)
            if pin:  # as on one server: a refused pin is the answer, and the registration stays
                await self._pin(info["id"])
                return JSONResponse({**info, "pinned": True}, status_code=response.status_code)
        return response

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        forwarded = await self._forwarded(request)
        response = await self._whole(forwarded, "")
        if response.status_code == 200:
            sent = json.loads(forwarded.body)
            await self.directory.put.remote(sent["lora_name"], sent["lora_path"], {"id": sent["lora_name"]})
        return response

    @app.post("/v1/adapters/{adapter_id:path}/pin")
    async def pin(self, adapter_id: str, request: Request) -> dict:
        """Hold the adapter in a slot on every replica (from their next report), out of Serve's model count; its
        requests then go to the shortest queue."""
        self._check_admin(request)
        await self._pin(adapter_id)
        return {"id": adapter_id, "pinned": True, "replicas": "all"}

    async def _pin(self, adapter_id: str) -> None:
        entry, full = await self.directory.pin.remote(adapter_id, True)
        if entry is None:
            raise APIError(404, f"adapter {adapter_id!r} is not registered", "model", "model_not_found")
        if full:
            raise APIError(
                409,
                f"all {self.config.pinned_slots} pinned slots per replica are taken (ClusterConfig.pinned_slots, "
                "--pinned-slots): unpin an adapter first",
                None,
                "slots_exhausted",
            )
        self.pinned.add(adapter_id)

    @app.post("/v1/adapters/{adapter_id:path}/unpin")
    async def unpin(self, adapter_id: str, request: Request) -> dict:
        self._check_admin(request)
        entry = await self.directory.get.remote(adapter_id)
        if entry is None:
            raise APIError(404, f"adapter {adapter_id!r} is not registered", "model", "model_not_found")
        if not entry.pinned:
            raise APIError(409, f"adapter {adapter_id!r} is not pinned by an operator", "model", "not_pinned")
        await self.directory.pin.remote(adapter_id, False)
        self.pinned.discard(adapter_id)
        return {"id": adapter_id, "pinned": False}

    @app.delete("/v1/adapters/{adapter_id:path}")
    async def unregister(self, adapter_id: str, request: Request) -> dict:
        self._check_admin(request)
        await self._remove(adapter_id)
        return {"id": adapter_id, "object": "adapter", "deleted": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        self._check_admin(request)
        body = await request.json()
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "lora_name is required", "lora_name")
        await self._remove(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def _known(self, adapter_id: str) -> bool:
        """Whether the directory has the adapter; a yes is trusted for KNOWN_TTL_S (this ingress's own deletes
        forget it at once), so a request costs no directory call."""
        now = time.monotonic()
        if now - self.known.get(adapter_id, -KNOWN_TTL_S) < KNOWN_TTL_S:
            return True
        entry = await self.directory.get.remote(adapter_id)
        if entry is None:
            return False
        self.known[adapter_id] = now
        if entry.pinned:
            self.pinned.add(adapter_id)
        else:
            self.pinned.discard(adapter_id)
        return True

    async def _remove(self, adapter_id: str) -> None:
        self.known.pop(adapter_id, None)
        self.pinned.discard(adapter_id)
        if not await self.directory.remove.remote(adapter_id):
            raise APIError(404, f"adapter {adapter_id!r} is not registered", "model", "model_not_found")

    # -- views across replicas --

    @app.get("/v1/models")
    async def models(self) -> dict:
        name, created = self.config.server.model_name, int(self.started_at)
        data = [{"id": name, "object": "model", "created": created, "owned_by": "adapter-manager"}]
        for entry in await self.directory.entries.remote():
            data.append(
                {
                    "id": entry.adapter_id,
                    "object": "model",
                    "created": created,
                    "owned_by": "adapter-manager",
                    "root": entry.info.get("source", entry.ref),
                    "parent": name,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/v1/adapters")
    async def adapters(self) -> dict:
        reports = await self.directory.reports.remote()
        entries = await self.directory.entries.remote()
        return {"object": "list", "data": [_adapter(e, reports) for e in entries]}

    @app.get("/v1/adapters/{adapter_id:path}")
    async def adapter(self, adapter_id: str) -> dict:
        entry = await self.directory.get.remote(adapter_id)
        if entry is None:
            raise APIError(404, f"adapter {adapter_id!r} is not registered", "model", "model_not_found")
        return _adapter(entry, await self.directory.reports.remote())

    @app.get("/v1/cluster/replicas")
    async def replicas_view(self) -> dict:
        """Every live replica's latest report: capacity, loaded adapters, heat, slots and swap metrics."""
        reports = await self.directory.reports.remote()
        return {"object": "list", "multiplexed": self.config.multiplexed, "data": list(reports.values())}

    @app.get("/v1/metrics/swaps")
    async def swaps(self) -> dict:
        """The single server's snapshot shape summed over live replicas (percentiles from the merged latency
        histograms: bucket upper bounds), with each replica's own snapshot under `replicas`."""
        reports = await self.directory.reports.remote()
        merged = merge_snapshots([report["metrics"] for report in reports.values()])
        merged["replicas"] = {r: report["metrics"] for r, report in reports.items()}
        return merged

    @app.get("/health")
    async def health(self) -> dict:
        reports = await self.directory.reports.remote()
        entries = await self.directory.entries.remote()
        return {
            "status": "ok",
            "model": self.config.server.model_name,
            "adapters": len(entries),
            "replicas": len(reports),
        }

    # -- forwarding --

    async def _forwarded(self, request: Request) -> ForwardedRequest:
        body = await request.body()
        if len(body) > self.config.server.max_body_bytes:
            raise APIError(413, f"request body exceeds {self.config.server.max_body_bytes} bytes")
        headers = tuple((k.lower(), v) for k, v in request.headers.raw)
        bare = ForwardedRequest(request.method, request.url.path, request.url.query.encode(), headers, b"")
        return _with_body(bare, body)

    def _handle(self, model_id: str) -> DeploymentHandle:
        options: dict[str, Any] = {"stream": True}
        if model_id:
            options["multiplexed_model_id"] = model_id
        return self.replicas.options(**options)

    async def _whole(self, forwarded: ForwardedRequest, model_id: str) -> Response:
        for attempt in range(ATTEMPTS):
            start, chunks = None, []
            try:
                async for part in self._handle(model_id).handle.remote(forwarded):
                    if isinstance(part, ResponseStart):
                        start = part
                    else:
                        chunks.append(part)
            except _REPLICA_GONE as err:
                log.warning("replica died under %s (try %d of %d): %s", forwarded.path, attempt + 1, ATTEMPTS, err)
                continue
            assert start is not None
            return _response(start, b"".join(chunks))
        raise _gone(forwarded)

    async def _stream(self, forwarded: ForwardedRequest, model_id: str) -> Response:
        for attempt in range(ATTEMPTS):
            parts = self._handle(model_id).handle.remote(forwarded).__aiter__()
            try:
                start = await anext(parts)
                first = await anext(parts, b"")
            except _REPLICA_GONE as err:
                log.warning("replica died under %s (try %d of %d): %s", forwarded.path, attempt + 1, ATTEMPTS, err)
                continue
            if start.status != 200:  # an error answer is whole JSON: send it as such
                rest = [p async for p in parts]
                return _response(start, b"".join([first, *rest]))
            return StreamingResponse(_relay(first, parts), status_code=start.status, headers=_headers(start))
        raise _gone(forwarded)

    def _check_admin(self, request: Request) -> None:
        token = self.config.server.admin_token
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(401, "admin routes need 'Authorization: Bearer <admin token>'", None, "unauthorized")
