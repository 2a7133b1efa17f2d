"""Engine logprobs in OpenAI's two response shapes: the completions API's parallel lists (tokens, token_logprobs,
top_logprobs, text_offset) and the chat API's ``content`` entries (token, logprob, bytes, top_logprobs).

A token's text is the tokenizer's decoding of that token alone, a special token's name (as vLLM does: U+FFFD for a byte
token that is part of a character); its bytes are the token's exact UTF-8 bytes (as OpenAI's: that byte). Logprobs are
clamped to -9999 (as vLLM does) so the JSON never holds -Infinity."""

from __future__ import annotations

from collections.abc import Iterable

from ..engine.sampling import TokenLogprobs
from ..model.tokenizer import Tokenizer
from .openai_schema import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_FLOOR = -9999.0
# (token id, its logprobs; None for a prompt's first token, which nothing predicts)
TokenEntry = tuple[int, TokenLogprobs | None]


def _clamp(value: float) -> float:
    return max(value, _FLOOR)


class CompletionLogprobsFormat:
    """One choice's logprobs, possibly over many stream chunks: text offsets run on from chunk to chunk."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self.offset = offset  # character offset of the next token in the choice's text

    def __call__(self, entries: Iterable[TokenEntry]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token, logprobs in entries:
            text = self._tokenizer.token_text(token)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(self._tokenizer.decode([token]))  # what the token adds to the text: specials none
            if logprobs is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(logprobs.logprob))
            top: dict[str, float] = {}
            for alternative, value in logprobs.top:  # tokens with the same text: the most likely one's logprob
                top.setdefault(self._tokenizer.token_text(alternative), _clamp(value))
            top.setdefault(text, _clamp(logprobs.logprob))  # OpenAI: the sampled token is always among them
            out.top_logprobs.append(top)
        return out


def chat_logprobs(tokenizer: Tokenizer, entries: Iterable[TokenLogprobs]) -> ChatLogprobs:
    """Generated tokens' logprobs as the chat API's ``logprobs.content``."""

    def top(token: int, logprob: float) -> TopLogprob:
        text = tokenizer.token_text(token)
        return TopLogprob(token=text, logprob=_clamp(logprob), bytes=list(tokenizer.token_bytes(token)))

    content = []
    for entry in entries:
        chosen = top(entry.token, entry.logprob)
        alternatives = [top(t, v) for t, v in entry.top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)
