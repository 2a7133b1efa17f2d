"""Request and response bodies of the HTTP server: the OpenAI completions/chat subset, the adapter admin API and
vLLM's LoRA load/unload bodies, as pydantic models (validation errors become OpenAI-shaped 400s)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_N = 8
MAX_PROMPTS = 32


class _Body(BaseModel):
    """Unknown fields are ignored (clients send fields such as ``user``); known unsupported ones are refused. Types
    are strict, as OpenAI's are: ``"8"``, ``true`` or ``8.0`` for an int, a string or a bool for a number, ``1`` for a
    bool are refused, not coerced (an int for a number is a JSON number)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str = Field(min_length=1, max_length=256)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # vLLM's extension (1 = none)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: no eos / stop token before this many tokens
    ignore_eos: bool = False  # vLLM's extension: keep generating past the end-of-sequence token

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def bias(self) -> dict[int, float]:
        """``logit_bias`` with integer keys; raises ValueError naming a key that is not a token id."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            out[int(key)] = value
        return out

    def top_logprobs_count(self) -> int | None:
        """Top-k alternatives per generated token; None: no logprobs."""
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first field set to something this server does not do, else None."""
        if len(self.stop_strings()) > MAX_STOP_STRINGS:
            return "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_strings())}"
        return None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: text, token ids, or a list of either (one choice set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return "best_of", "best_of is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 is only meaningful with echo (score the prompt)"
        return super().unsupported()


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _not_null(cls, content: object) -> object:
        if content is None:
            raise ValueError("content must be text or a list of text parts, got null (tool calls are not supported)")
        return content

    def text(self) -> str:
        """The message's text; only text parts are served (others are refused before this is called)."""
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    response_format: dict | None = None

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools / function calling are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only response_format type 'text' is supported"
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list) and any(p.type != "text" for p in message.content):
                return f"messages[{i}].content", "only text content parts are supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The completions API's logprobs: per token its text, logprob, top alternatives (text -> logprob, the chosen
    token included) and its character offset in the choice's text; the first prompt token of an echo has None."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    """One token of the chat API's logprobs: its text decoded alone, a special token's name (vLLM's; U+FFFD for a
    byte token that is part of a character) and its exact UTF-8 bytes (OpenAI's; always sent here)."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class RegisterAdapterRequest(_Body):
    """POST /v1/adapters: a hub id ``org/name`` (optional ``revision``) or a local directory (starts with / or ./)."""

    ref: str = Field(min_length=1, max_length=1024)
    id: str | None = Field(None, min_length=1, max_length=200)
    revision: str | None = Field(None, min_length=1, max_length=128)
    refresh: bool = False  # re-resolve a branch revision (fetch its newest commit)
    pin: bool = False  # operator-pin it into a slot once registered

    def full_ref(self) -> str:
        return f"{self.ref}@{self.revision}" if self.revision else self.ref


class LoadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_path: str = Field(min_length=1, max_length=1024)
    load_inplace: bool = False  # replace an adapter already registered under lora_name


class UnloadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=200)
    lora_int_id: int | None = None
