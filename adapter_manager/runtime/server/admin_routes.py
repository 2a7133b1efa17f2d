"""The adapter admin API, and vLLM's LoRA load/unload routes so vLLM clients work unchanged.

    POST   /v1/adapters                  {"ref", "id"?, "revision"?, "refresh"?, "pin"?}  201 registered, 200 otherwise
    GET    /v1/adapters                  every adapter with its tier
    GET    /v1/adapters/{id}             one adapter with its swap history
    DELETE /v1/adapters/{id}
    POST   /v1/adapters/{id}/pin         keep it in a device slot;  POST /v1/adapters/{id}/unpin
    POST   /v1/load_lora_adapter         vLLM: {"lora_name", "lora_path", "load_inplace"?}
    POST   /v1/unload_lora_adapter       vLLM: {"lora_name"}

Ids, refs and revisions are validated from their text before any file or network access. A local directory is
refused (403) unless the server was given local roots (`--local-root DIR`) and it lies under one of them; the CLI's
start-up `--adapter PATH` is not an API call and stays allowed. With a state directory, a registration is committed
to it before the answer, and an unregistration removed from it; registrations that could not be restored at start-up
are listed with status "unrestorable" and their error until unregistered or registered again.
Ids may hold '/', so they are path-converter parameters. Routes that change state need the admin bearer token when
one is configured. Registration (download, validation, preparation) runs on the server's registration threads, so
serving never waits for it; any failure is answered with its status and leaves the server running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Header
from fastapi.responses import JSONResponse, PlainTextResponse

from adapter_manager import (
    AdapterManager,
    AdapterRecord,
    AdapterRef,
    AdapterResidency,
    UnrestoredAdapter,
    check_adapter_id,
)

from .http_errors import to_api_error
from .openai_schema import LoadLoraAdapterRequest, RegisterAdapterRequest, UnloadLoraAdapterRequest
from .state import ServerState


def admin_router(state: ServerState) -> APIRouter:
    def require_admin(authorization: str | None = Header(None)) -> None:
        state.check_admin(authorization)

    admin = [Depends(require_admin)]
    router = APIRouter()
    manager = state.manager

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        """Run a manager call on a registration thread; its failure becomes an API error."""
        try:
            return await asyncio.get_running_loop().run_in_executor(state.registrations, fn, *args)
        except Exception as err:  # noqa: BLE001 - an adapter's failure is the client's answer, never a crash
            raise to_api_error(err) from err

    async def register(
        ref: str, revision: str | None, adapter_id: str | None, refresh: bool, pin: bool
    ) -> tuple[str, dict]:
        if adapter_id is not None:
            check_adapter_id(adapter_id)
        state.check_ref(ref, revision)
        full_ref = ref if revision is None else f"{ref}@{revision}"
        result = await off_loop(manager.register, full_ref, adapter_id, refresh)
        adapter_id = result.record.adapter_id
        if pin:
            await off_loop(manager.pin, adapter_id)
        return result.action, adapter_info(manager, result.record)

    @router.post("/v1/adapters", dependencies=admin)
    async def register_adapter(body: RegisterAdapterRequest) -> JSONResponse:
        try:
            action, info = await register(body.ref, body.revision, body.id, body.refresh, body.pin)
        except Exception as err:  # noqa: BLE001
            raise to_api_error(err) from err
        return JSONResponse({**info, "action": action}, status_code=201 if action == "registered" else 200)

    @router.get("/v1/adapters")
    def list_adapters() -> dict:
        residency = manager.residency()
        data = [adapter_info(manager, r, residency.get(r.adapter_id)) for r in manager.records()]
        data += [unrestored_info(u) for u in manager.unrestored()]
        return {"object": "list", "data": sorted(data, key=lambda a: a["id"])}

    @router.post("/v1/adapters/{adapter_id:path}/pin", dependencies=admin)
    async def pin(adapter_id: str) -> dict:
        slot = await off_loop(manager.pin, _known(manager, adapter_id))
        return {"id": adapter_id, "pinned": True, "slot": slot}

    @router.post("/v1/adapters/{adapter_id:path}/unpin", dependencies=admin)
    async def unpin(adapter_id: str) -> dict:
        await off_loop(manager.unpin, _known(manager, adapter_id))
        return {"id": adapter_id, "pinned": False}

    @router.get("/v1/adapters/{adapter_id:path}")
    def get_adapter(adapter_id: str) -> dict:
        unrestored = _unrestored(manager, adapter_id)
        if unrestored is not None:
            return unrestored_info(unrestored)
        record = _record(manager, adapter_id)
        info = adapter_info(manager, record)
        moves = manager.moves(adapter_id)
        info["moves"] = [{"move": m.move.value, "seconds": m.seconds, "bytes": m.nbytes, "at": m.at} for m in moves]
        return info

    @router.delete("/v1/adapters/{adapter_id:path}", dependencies=admin)
    async def unregister(adapter_id: str) -> dict:
        await off_loop(manager.unregister, _known(manager, adapter_id))
        return {"id": adapter_id, "object": "adapter", "deleted": True}

    @router.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        try:
            state.check_ref(body.lora_path)  # before an in-place load drops the adapter it replaces
            refresh = False
            if body.load_inplace and manager.is_registered(body.lora_name):
                if _same_source(manager.record(body.lora_name), body.lora_path):
                    refresh = True  # read again and updated in place: its requests never see it missing
                else:  # another source under the name: the old one goes first
                    await off_loop(manager.unregister, body.lora_name)
            await register(body.lora_path, None, body.lora_name, refresh, False)
        except Exception as err:  # noqa: BLE001
            raise to_api_error(err) from err
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        await off_loop(manager.unregister, _known(manager, body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


def _same_source(record: AdapterRecord, ref: str) -> bool:
    """Whether ``ref`` names the repo or folder ``record`` was registered from (any revision)."""
    parsed = AdapterRef.parse(ref)
    return (record.ref.repo_id, record.ref.path) == (parsed.repo_id, parsed.path)


def adapter_info(manager: AdapterManager, record: AdapterRecord, residency: AdapterResidency | None = None) -> dict:
    """One adapter as the admin API shows it: source, revision, size, and where it lives now."""
    if residency is None:
        residency = manager.residency().get(record.adapter_id)
    state = next((s for s in manager.slot_states() if s.adapter_id == record.adapter_id), None)
    return {
        "id": record.adapter_id,
        "object": "adapter",
        "source": str(record.ref),
        "revision": record.ref.revision,
        "sha": record.sha,
        "digest": record.digest,  # what the adapter is: its content's sha256 digest (sources.digests)
        "rank": record.rank,
        "variant": record.variant.value,  # lora, dora or lora_bias
        "vocab": record.vocab,  # {"embed_tokens" | "lm_head": "lora" | "tokens"}: LoRA or trainable tokens there
        "modules": len(record.modules),
        "bytes": record.nbytes,
        "base_model": record.base_model,
        "registered_at": record.registered_at,
        "warnings": list(record.warnings),
        "status": state.state if state is not None else "registered",  # loading / ready (in a slot) / draining
        "tier": residency.tier if residency else "disk",
        "slot": residency.slot if residency else None,
        "pinned": bool(state and state.manual),  # operator pin
        "in_flight": state.pins if state is not None else 0,  # batches holding it now
        "last_used": residency.last_used if residency else None,
    }


def unrestored_info(unrestored: UnrestoredAdapter) -> dict:
    """A durable registration that could not be restored at start-up: its source, sha and why."""
    row = unrestored.registration
    return {
        "id": row.adapter_id,
        "object": "adapter",
        "source": row.ref,
        "revision": row.revision,
        "sha": row.sha,
        "digest": row.digest,
        "rank": None,
        "variant": None,
        "vocab": {},
        "modules": 0,
        "bytes": 0,
        "registered_at": row.registered_at,
        "warnings": [],
        "status": "unrestorable",  # unregister it, or register it again once its source is back
        "error": unrestored.error,
        "tier": None,
        "slot": None,
        "pinned": row.pinned,
        "in_flight": 0,
        "last_used": None,
    }


def _unrestored(manager: AdapterManager, adapter_id: str) -> UnrestoredAdapter | None:
    return next((u for u in manager.unrestored() if u.registration.adapter_id == adapter_id), None)


def _known(manager: AdapterManager, adapter_id: str) -> str:
    if _unrestored(manager, adapter_id) is not None:
        return adapter_id
    return _record(manager, adapter_id).adapter_id


def _record(manager: AdapterManager, adapter_id: str) -> AdapterRecord:
    try:
        return manager.record(check_adapter_id(adapter_id))
    except Exception as err:  # noqa: BLE001
        raise to_api_error(err) from err
