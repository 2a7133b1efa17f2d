"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE streams) and
``GET /v1/models``. ``model`` names the base model or a registered adapter.

A stream's status is decided by its first token: a request that fails before it (unknown or unregistered adapter,
overload) gets a plain JSON error with its status code; a failure after it ends the stream with an OpenAI error
event."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from ..engine.sampling import SamplingParams
from .chat_template import ChatTemplateError
from .generation import TextDecoder, finish_reason
from .http_errors import APIError, error_body, to_api_error
from .openai_schema import (
    MAX_PROMPTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    Usage,
)
from .state import ServerState

# (choice index, text delta, finish reason or None) -> one SSE chunk body
_ChunkFn = Callable[[int, str, str | None], dict]


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    def list_models() -> dict:
        created = int(state.started_at)
        data = [{"id": state.config.model_name, "object": "model", "created": created, "owned_by": "adapter-manager"}]
        residency = state.manager.residency()
        for record in state.manager.registry.list():
            where = residency.get(record.adapter_id)
            data.append(
                {
                    "id": record.adapter_id,
                    "object": "model",
                    "created": int(record.registered_at),
                    "owned_by": "adapter-manager",
                    "root": str(record.ref),
                    "parent": state.config.model_name,
                    "tier": where.tier if where else "disk",
                }
            )
        return {"object": "list", "data": data}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest):
        adapter_id = _admit(state, body)
        prompts = []
        for i, prompt in enumerate(body.prompts()):
            if isinstance(prompt, str):
                prompt = state.tokenizer.encode(prompt)
            if not prompt:
                raise APIError(400, f"prompt {i} is empty", "prompt")
            prompts.append(prompt)
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None) -> dict:
            choice = CompletionChoice(index=index, text=text, finish_reason=finish)
            return CompletionResponse(id=rid, created=created, model=body.model, choices=[choice]).model_dump()

        requests = _requests(state, body, prompts, body.max_tokens or 16)
        if body.stream:
            return await _stream(state, body, requests, adapter_id, chunk)
        results, usage = await _complete(state, body, requests, adapter_id)
        choices = [CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason) for i, r in enumerate(results)]
        return CompletionResponse(id=rid, created=created, model=body.model, choices=choices, usage=usage)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        adapter_id = _admit(state, body)
        template = state.config.chat_template
        try:
            text = template.render([{"role": m.role, "content": m.text()} for m in body.messages])
        except ChatTemplateError as err:
            raise APIError(400, str(err), "messages") from err
        prompt = state.tokenizer.encode(text, add_bos=not template.from_checkpoint)
        room = state.engine.config.max_seq_len - len(prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens or min(state.config.default_chat_max_tokens, room)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str, finish: str | None) -> dict:
            delta = ChatDelta(role="assistant", content=text) if finish is None else ChatDelta(content=text or None)
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish)
            return ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[choice]).model_dump()

        requests = _requests(state, body, [prompt], max(max_tokens, 1))
        if body.stream:
            return await _stream(state, body, requests, adapter_id, chunk)
        results, usage = await _complete(state, body, requests, adapter_id)
        choices = [
            ChatChoice(index=i, message=AssistantMessage(content=r.text), finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ]
        return ChatCompletionResponse(id=rid, created=created, model=body.model, choices=choices, usage=usage)

    return router


def _admit(state: ServerState, body: SamplingFields) -> str | None:
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, unsupported[1], unsupported[0], "unsupported_parameter")
    return state.adapter_for(body.model)


def _requests(
    state: ServerState, body: SamplingFields, prompts: list[list[int]], max_tokens: int
) -> list[tuple[list[int], SamplingParams]]:
    """`n` engine requests per prompt; choice j of a seeded request uses seed + j so the choices differ."""
    eos = state.tokenizer.eos_id
    stop_ids = () if body.ignore_eos or eos is None else (eos,)
    out = []
    for prompt in prompts:
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            try:
                params = SamplingParams(max_tokens, body.temperature, body.top_p, seed, stop_ids, body.ignore_eos)
            except ValueError as err:
                raise APIError(400, str(err), "max_tokens") from err
            out.append((prompt, params))
    return out


async def _complete(state: ServerState, body: SamplingFields, requests, adapter_id: str | None):
    generator, stops = state.generator, body.stop_strings()
    try:
        async with generator.run(requests, adapter_id) as handles:
            results = await asyncio.gather(*(generator.complete(h, stops) for h in handles))
    except Exception as err:  # noqa: BLE001 - every failure becomes an OpenAI error with its status
        raise to_api_error(err, "model") from err
    prompt_tokens = sum(len(p) for p, _ in requests[:: body.n])
    completion_tokens = sum(r.completion_tokens for r in results)
    return results, Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


async def _stream(
    state: ServerState, body: SamplingFields, requests, adapter_id: str | None, chunk: _ChunkFn
) -> StreamingResponse:
    generator, stops = state.generator, body.stop_strings()
    stack = AsyncExitStack()
    try:
        handles = await stack.enter_async_context(generator.run(requests, adapter_id))
        first_tokens = generator.tokens(handles[0])
        first = await anext(first_tokens, None)
    except Exception as err:  # noqa: BLE001 - nothing sent yet: answer with the error's own status
        await stack.aclose()
        raise to_api_error(err, "model") from err

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        async with stack:
            try:
                for index, handle in enumerate(handles):
                    decoder = TextDecoder(state.tokenizer, stops)
                    tokens = first_tokens if index == 0 else generator.tokens(handle)
                    if index == 0 and first is not None:
                        yield _sse(chunk(index, decoder.add(first), None))
                    if not decoder.stopped:
                        async for token in tokens:
                            text = decoder.add(token)
                            if text:
                                yield _sse(chunk(index, text, None))
                            if decoder.stopped:
                                break
                    completion_tokens += decoder.tokens
                    yield _sse(chunk(index, decoder.flush(), finish_reason(handle, decoder)))
                if body.stream_options is not None and body.stream_options.include_usage:
                    prompt_tokens = sum(len(p) for p, _ in requests[:: body.n])
                    usage = Usage(
                        prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens,
                    )
                    yield _sse({**chunk(0, "", None), "choices": [], "usage": usage.model_dump()})
            except Exception as err:  # noqa: BLE001 - headers are sent: report in the stream, then end it
                api = to_api_error(err, "model")
                yield _sse(error_body(api.status, api.message, api.param, api.code))
            yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
