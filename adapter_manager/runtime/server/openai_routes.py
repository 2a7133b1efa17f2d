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

from ..engine.request import RequestHandle
from ..engine.sampling import SamplingParams, SamplingParamsError
from .chat_template import ChatTemplateError
from .generation import finish_reason
from .http_errors import APIError, error_body, to_api_error
from .openai_logprobs import CompletionLogprobsFormat, TokenEntry, chat_logprobs
from .openai_schema import (
    MAX_PROMPTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    Usage,
)
from .state import ServerState

# (choice index, text delta, finish reason or None, token entries whose text the delta carries) -> one SSE chunk body
_ChunkFn = Callable[[int, str, str | None, list[TokenEntry]], dict]


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    def list_models() -> dict:
        created = int(state.started_at)
        data = [{"id": state.config.model_name, "object": "model", "created": created, "owned_by": "adapter-manager"}]
        residency = state.manager.residency()
        for record in state.manager.records():
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
        prompts, texts = [], []
        for i, prompt in enumerate(body.prompts()):
            text = prompt if isinstance(prompt, str) else None
            if isinstance(prompt, str):
                prompt = state.tokenizer.encode(prompt)
            if not prompt:
                raise APIError(400, f"prompt {i} is empty", "prompt")
            prompts.append(prompt)
            texts.append(text)
        if not prompts:
            raise APIError(400, "prompt must hold at least one prompt (text or token ids)", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        k = body.logprobs
        formats: dict[int, CompletionLogprobsFormat] = {}

        def prompt_text(index: int) -> str:
            text = texts[index // body.n]
            return text if text is not None else state.tokenizer.decode(prompts[index // body.n])

        def logprobs(index: int, entries: list[TokenEntry]) -> CompletionLogprobs | None:
            if k is None:
                return None
            if index not in formats:
                formats[index] = CompletionLogprobsFormat(state.tokenizer)
            return formats[index](entries)

        def chunk(index: int, text: str, finish: str | None, entries: list[TokenEntry]) -> dict:
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs(index, entries), finish_reason=finish)
            return CompletionResponse(id=rid, created=created, model=body.model, choices=[choice]).model_dump()

        def echo(index: int, handle: RequestHandle) -> tuple[str, CompletionLogprobs | None]:
            """The prompt's text and, with logprobs, its tokens' (once the prompt is scored); offsets run on after."""
            text, scored = prompt_text(index), None
            if k is not None:
                scored = logprobs(index, list(zip(prompts[index // body.n], handle.prompt_logprobs, strict=True)))
                formats[index].offset = len(text)
            return text, scored

        def echoed(index: int, handle: RequestHandle) -> dict:
            text, scored = echo(index, handle)
            choice = CompletionChoice(index=index, text=text, logprobs=scored, finish_reason=None)
            return CompletionResponse(id=rid, created=created, model=body.model, choices=[choice]).model_dump()

        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        requests = _requests(state, body, prompts, max_tokens, echo=body.echo)
        if body.stream:
            opening = echoed if body.echo else None
            return await _stream(state, body, requests, adapter_id, chunk, opening, every_token=True)
        results, handles, usage = await _complete(state, body, requests, adapter_id)
        choices = []
        for i, (result, handle) in enumerate(zip(results, handles, strict=True)):
            head, scored = echo(i, handle) if body.echo else ("", None)
            tail = logprobs(i, [(lp.token, lp) for lp in result.logprobs])
            if scored is not None and tail is not None:
                tail = CompletionLogprobs(**{key: getattr(scored, key) + value for key, value in tail})
            finish = result.finish_reason
            choices.append(CompletionChoice(index=i, text=head + result.text, logprobs=tail, finish_reason=finish))
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
        asked = body.top_logprobs_count() is not None

        def logprobs(entries: list[TokenEntry]) -> ChatLogprobs | None:
            return chat_logprobs(state.tokenizer, [lp for _, lp in entries if lp is not None]) if asked else None

        def chunk(index: int, text: str, finish: str | None, entries: list[TokenEntry]) -> dict:
            delta = ChatDelta(content=text) if finish is None else ChatDelta(content=text or None)
            return chat_chunk(
                ChatChunkChoice(index=index, delta=delta, logprobs=logprobs(entries), finish_reason=finish)
            )

        def opening(index: int, handle: RequestHandle) -> dict:
            """A choice's first chunk, sent once its request is admitted: the role, no text yet (as OpenAI does)."""
            return chat_chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))

        def chat_chunk(choice: ChatChunkChoice) -> dict:
            return ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[choice]).model_dump()

        try:
            requests = _requests(state, body, [prompt], max(max_tokens, 1))
            if body.stream:
                return await _stream(state, body, requests, adapter_id, chunk, opening)
            results, _, usage = await _complete(state, body, requests, adapter_id)
        except APIError as err:
            raise _chat_param(err) from err
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=r.text),
                logprobs=chat_logprobs(state.tokenizer, r.logprobs) if asked else None,
                finish_reason=r.finish_reason,
            )
            for i, r in enumerate(results)
        ]
        return ChatCompletionResponse(id=rid, created=created, model=body.model, choices=choices, usage=usage)

    return router


def _chat_param(err: APIError) -> APIError:
    """A chat request has no ``prompt``: the engine's prompt refusals name ``messages`` (as OpenAI's do)."""
    if err.param != "prompt":
        return err
    return APIError(err.status, err.message, "messages", err.code)


def _admit(state: ServerState, body: SamplingFields) -> str | None:
    unsupported = body.unsupported()
    if unsupported is not None:
        raise APIError(400, unsupported[1], unsupported[0], "unsupported_parameter")
    return state.adapter_for(body.model)


def _requests(
    state: ServerState, body: SamplingFields, prompts: list[list[int]], max_tokens: int, echo: bool = False
) -> list[tuple[list[int], SamplingParams]]:
    """`n` engine requests per prompt; choice j of a seeded request uses seed + j so the choices differ. With echo
    and logprobs the prompt is scored too (a prompt-only echo, max_tokens 0, scores it without reporting)."""
    eos = state.tokenizer.eos_id
    stop_ids = () if body.ignore_eos or eos is None else (eos,)
    k = body.top_logprobs_count()
    try:
        bias = body.bias()
    except ValueError as err:
        raise APIError(400, str(err), "logit_bias") from err
    out = []
    for prompt in prompts:
        for j in range(body.n):
            try:
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    seed=None if body.seed is None else body.seed + j,
                    stop_ids=stop_ids,
                    ignore_eos=body.ignore_eos,
                    logprobs=k,
                    prompt_logprobs=(k or 0) if echo and (k is not None or max_tokens == 0) else None,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    logit_bias=bias,
                    min_tokens=body.min_tokens,
                )
            except SamplingParamsError as err:
                raise APIError(400, str(err), err.param) from err
            out.append((prompt, params))
    return out


async def _complete(state: ServerState, body: SamplingFields, requests, adapter_id: str | None):
    generator, stops = state.generator, body.stop_strings()
    try:
        async with generator.run(requests, adapter_id) as handles:
            results = await asyncio.gather(*(generator.complete(h, stops, body.min_tokens) for h in handles))
    except Exception as err:  # noqa: BLE001 - every failure becomes an OpenAI error with its status
        raise to_api_error(err, "model") from err
    prompt_tokens = sum(len(p) for p, _ in requests[:: body.n])
    completion_tokens = sum(r.completion_tokens for r in results)
    return (
        results,
        handles,
        Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
    )


async def _stream(
    state: ServerState,
    body: SamplingFields,
    requests,
    adapter_id: str | None,
    chunk: _ChunkFn,
    opening: Callable[[int, RequestHandle], dict] | None = None,
    every_token: bool = False,
) -> StreamingResponse:
    """An SSE stream, choice after choice; ``opening`` gives a choice's first chunk (chat: the role; an echo: the
    prompt, once it is scored) before its tokens. A chunk carries the logprobs of the tokens whose text it brings
    (held-back text: in a later chunk); with ``every_token`` each token brings a chunk even while its text is held
    back (an incomplete UTF-8 character, a possible stop string), with an empty text and that token's logprobs."""
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
                    decoder = state.generator.decoder(handle, stops, body.min_tokens)
                    tokens = first_tokens if index == 0 else generator.tokens(handle)
                    head = first if index == 0 else await anext(tokens, None)
                    if opening is not None:
                        yield _sse(opening(index, handle))
                    pending: list[TokenEntry] = []
                    async for token, logprobs in _prepend(head, tokens):
                        pending.append((token, logprobs))
                        text = decoder.add(token)
                        if text or every_token:
                            yield _sse(chunk(index, text, None, pending))
                            pending = []
                        if decoder.stopped:
                            break
                    completion_tokens += decoder.tokens
                    yield _sse(chunk(index, decoder.flush(), finish_reason(handle, decoder), pending))
                if body.stream_options is not None and body.stream_options.include_usage:
                    prompt_tokens = sum(len(p) for p, _ in requests[:: body.n])
                    usage = Usage(
                        prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens,
                        total_tokens=prompt_tokens + completion_tokens,
                    )
                    yield _sse({**chunk(0, "", None, []), "choices": [], "usage": usage.model_dump()})
            except Exception as err:  # noqa: BLE001 - headers are sent: report in the stream, then end it
                api = to_api_error(err, "model")
                yield _sse(error_body(api.status, api.message, api.param, api.code))
            yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _prepend(head: TokenEntry | None, rest: AsyncIterator[TokenEntry]) -> AsyncIterator[TokenEntry]:
    if head is None:
        return
    yield head
    async for item in rest:
        yield item


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
