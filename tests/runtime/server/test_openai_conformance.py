"""What OpenAI and vLLM clients expect to the letter, through the official `openai` client: the role in a streamed
chat's first chunk, a streamed completion's chunk for every token (even while its text is held back), and every
parameter error naming its parameter."""

from __future__ import annotations

import pytest

from tests.runtime.server.conftest import NAME

openai = pytest.importorskip("openai")

HELD = {"200": 100}  # byte 0xC8 opens a two-byte UTF-8 character that never completes: its text is held back


def _chat(client, **kwargs):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], **kwargs)


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_streamed_chat_sends_the_role_first_even_when_the_text_is_held_back(client, max_tokens):
    kwargs = dict(max_tokens=max_tokens, temperature=0, logit_bias=HELD)
    whole = _chat(client, **kwargs)
    chunks = list(_chat(client, stream=True, **kwargs))
    first = chunks[0].choices[0].delta
    assert (first.role, first.content) == ("assistant", "")
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_streamed_completion_sends_a_chunk_per_token_while_text_is_held_back(client):
    kwargs = dict(model=NAME, prompt="hi", max_tokens=3, temperature=0, logit_bias=HELD, logprobs=1)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    running = [c.choices[0] for c in chunks if c.choices[0].finish_reason is None]
    assert len(running) == 3  # one per generated token, before the stream ends
    assert all(choice.text == "" and len(choice.logprobs.tokens) == 1 for choice in running)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [lp for choice in running for lp in choice.logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)


def _refusal(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("stream", [False, True])
def test_parameter_errors_name_their_parameter(client, stream):
    complete = lambda **kw: client.completions.create(model=NAME, stream=stream, **kw)  # noqa: E731
    chat = lambda **kw: _chat(client, stream=stream, **kw)  # noqa: E731
    cases = [
        (lambda: complete(prompt=[]), "prompt"),
        (lambda: complete(prompt=[[]]), "prompt"),
        (lambda: complete(prompt=[1, 100_000]), "prompt"),  # a token id past the vocabulary
        (lambda: complete(prompt="x" * 80, max_tokens=4), "prompt"),  # longer than max_seq_len
        (lambda: complete(prompt="hi", logit_bias={"100000": 5}), "logit_bias"),
        (lambda: complete(prompt="hi", logit_bias={"x": 5}), "logit_bias"),
        (lambda: complete(prompt="hi", logit_bias={"5": 500}), "logit_bias"),
        (lambda: complete(prompt="hi", temperature=9), "temperature"),
        (lambda: complete(prompt="hi", suffix="!"), "suffix"),
        (lambda: chat(logit_bias={"100000": 5}), "logit_bias"),
        (lambda: chat(max_tokens=80), "messages"),  # the prompt and the completion do not fit
        (lambda: chat(top_logprobs=2), "top_logprobs"),
    ]
    for call, param in cases:
        err = _refusal(call)
        assert err.param == param, (param, err.body)


_HI = [{"role": "user", "content": "hi"}]
# (route, field, value) that lax pydantic would coerce: a string, a bool or a whole float for an int, a string or a
# bool for a number, an int or a string for a bool
_WRONG_TYPES = [
    *[("completions", "max_tokens", v) for v in ("8", True, 8.0)],
    *[("completions", field, v) for field in ("n", "seed", "min_tokens", "logprobs", "best_of") for v in ("1", True)],
    *[
        (route, field, v)
        for route in ("completions", "chat/completions")
        for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        for v in ("1", True)
    ],
    *[
        (route, field, v)
        for route in ("completions", "chat/completions")
        for field in ("stream", "ignore_eos")
        for v in (1, "true")
    ],
    ("completions", "echo", 1),
    ("chat/completions", "max_tokens", "8"),
    ("chat/completions", "max_completion_tokens", True),
    ("chat/completions", "logprobs", 1),
    ("chat/completions", "top_logprobs", "2"),
]


@pytest.mark.parametrize(("route", "field", "value"), _WRONG_TYPES)
def test_wrong_json_types_are_refused_not_coerced(server, route, field, value):
    httpx = pytest.importorskip("httpx")
    body = {"model": NAME, "max_tokens": 2, **({"prompt": "hi"} if route == "completions" else {"messages": _HI})}
    answer = httpx.post(f"{server[1].url}/v1/{route}", json={**body, field: value}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field and answer.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [[1, True]]}, "prompt"),
        ({"prompt": "hi", "logit_bias": {"5": True}}, "logit_bias.5"),
        ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_wrong_json_types_inside_values_name_where(server, extra, param):
    httpx = pytest.importorskip("httpx")
    answer = httpx.post(f"{server[1].url}/v1/completions", json={"model": NAME, "max_tokens": 2, **extra}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_whole_numbers_are_numbers(client):
    out = client.completions.create(
        model=NAME, prompt="hi", max_tokens=2, temperature=1, top_p=1, presence_penalty=0, logit_bias={"5": 1}
    )
    assert out.usage.completion_tokens <= 2


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_null_message_content_is_refused_for_every_role(client, role):
    for content in ({"content": None}, {}):
        messages = [{"role": "system", "content": "Be brief."}, {"role": role, **content}]
        err = _refusal(lambda: client.chat.completions.create(model=NAME, messages=messages, max_tokens=2))  # noqa: B023
        assert err.param == "messages[1].content", err.body
