"""Token bytes through the real server and the official `openai` client: chat logprobs carry each token's exact UTF-8
bytes (a byte token splitting a character included), and the model's special ids never reach the text (the random
checkpoint's eos is 2, a byte id to the byte-level fallback tokenizer)."""

from __future__ import annotations

import pytest

from adapter_manager.runtime.engine.sampling import SamplingParams
from tests.runtime.server.conftest import CONFIG, NAME

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "x"}]
MODEL_EOS = CONFIG.eos_token_ids[0]


def _exact_bytes(token: int) -> list[int]:
    """The byte-level fallback's token bytes, written out: ids 0..255 are bytes, but for the model's bos / eos."""
    return [token] if token < 256 and token not in (CONFIG.bos_token_id, *CONFIG.eos_token_ids) else []


def test_chat_logprobs_carry_each_tokens_exact_bytes(server, client):
    """0xC8 is the lead byte of a two-byte character: alone it is no text (U+FFFD, as vLLM shows it), but its bytes
    are exact (as OpenAI's); so are the alternatives' (the raw model's top 20, as vLLM's: before the bias)."""
    serving, _ = server
    kwargs = dict(model=NAME, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True, top_logprobs=20)
    out = client.chat.completions.create(**kwargs, logit_bias={"200": 100})
    (entry,) = out.choices[0].logprobs.content
    assert entry.bytes == [200] and entry.token == "\ufffd"
    template = serving.app.state.server.config.chat_template
    ids = serving.app.state.server.tokenizer.encode(template.render(MESSAGES), add_bos=not template.from_checkpoint)
    direct = serving.engine.submit(ids, None, SamplingParams(max_tokens=1, logprobs=20, logit_bias={200: 100}))
    direct.result(timeout=60)
    alternatives = [token for token, _ in direct.logprobs[0].top]
    assert [t.bytes for t in entry.top_logprobs] == [_exact_bytes(t) for t in alternatives]
    assert any(128 <= t < 256 for t in alternatives)  # the seeded weights rank a partial character among them
    chunks = list(client.chat.completions.create(**kwargs, logit_bias={"200": 100}, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [entry.model_dump()]


def test_the_models_eos_never_reaches_the_text(client):
    kwargs = dict(model=NAME, messages=MESSAGES, temperature=0, logit_bias={str(MODEL_EOS): 100})
    stopped = client.chat.completions.create(**kwargs, max_tokens=4, logprobs=True)
    choice = stopped.choices[0]
    assert choice.message.content == "" and choice.finish_reason == "stop"  # was "\u0002"
    assert [(e.token, e.bytes) for e in choice.logprobs.content] == [("", [])]
    kept = client.chat.completions.create(**kwargs, max_tokens=3, extra_body={"ignore_eos": True})
    assert kept.choices[0].message.content == "" and kept.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(**kwargs, max_tokens=3, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    text = client.completions.create(
        model=NAME, prompt="x", max_tokens=2, temperature=0, logit_bias=kwargs["logit_bias"]
    )
    assert text.choices[0].text == ""
