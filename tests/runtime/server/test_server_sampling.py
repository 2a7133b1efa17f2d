"""Logprobs, echo and the sampling options through the real server and the official `openai` client, JSON and SSE,
checked against the engine's own results for the same request (whose logprobs test_sampling checks against HF)."""

from __future__ import annotations

import pytest

from adapter_manager import AdapterManagerConfig, RowOptions, write_synthetic_adapter
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.engine.sampling import SamplingParams
from adapter_manager.runtime.model.tokenizer import ByteTokenizer
from adapter_manager.runtime.server.generation import TextDecoder
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.server.conftest import CONFIG, NAME, serving_on

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

EOS = 257  # the byte tokenizer's


@pytest.fixture(scope="module")
def server(checkpoint_root):
    root = checkpoint_root
    write_synthetic_adapter(root / "ad", CONFIG.to_spec(NAME), r=4, lora_alpha=8, seed=1)
    with serving_on(
        root / "model",
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8)),
        EngineConfig(max_batch=8, max_seq_len=96),
        ServerConfig(model_name=NAME, port=0, max_pending=32),
        adapters={"team/ad": root / "ad"},
    ) as started:
        yield started


def _engine(serving, prompt: list[int], adapter: str | None, **kwargs):
    handle = serving.engine.submit(prompt, adapter, SamplingParams(**kwargs))
    handle.result(timeout=60)
    return handle


def test_completion_logprobs_and_echo_equal_the_engine(server, client):
    serving, _ = server
    tokenizer = serving.app.state.server.tokenizer
    prompt = "Hello there"
    ids = tokenizer.encode(prompt)
    kwargs = dict(model="team/ad", prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True)
    out = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    direct = _engine(serving, ids, "team/ad", max_tokens=5, logprobs=3, prompt_logprobs=3, ignore_eos=True)
    choice = out.choices[0]
    generated = direct.result(timeout=0)
    assert choice.text == prompt + tokenizer.decode(generated)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids + generated]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first prompt token
    expected = [e.logprob for e in direct.prompt_logprobs[1:]] + [e.logprob for e in direct.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-6)
    for top, entry in zip(lp.top_logprobs[1:], direct.prompt_logprobs[1:] + direct.logprobs, strict=True):
        want: dict[str, float] = {}
        for t, v in (*entry.top, (entry.token, entry.logprob)):  # texts may repeat (ids >= 258 decode to "")
            want.setdefault(tokenizer.decode([t]), v)
        assert top == pytest.approx(want, abs=1e-6)
    offsets = [0]
    for token in lp.tokens[: len(ids) - 1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset[: len(ids)] == offsets
    assert lp.text_offset[len(ids)] == len(prompt)  # the first generated token starts right after the echo
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == len(ids)

    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in streamed if c.logprobs for x in getattr(c.logprobs, field)] == getattr(lp, field)


def test_echo_with_max_tokens_0_scores_the_prompt(server, client):
    """The lm-eval-harness loglikelihood request: echo, logprobs, max_tokens 0, token-id prompts in a batch."""
    serving, _ = server
    prompts = [[256, 72, 105, 33], [256, 10, 20]]
    out = client.completions.create(model=NAME, prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert out.usage.completion_tokens == 0
    for prompt, choice in zip(prompts, out.choices, strict=True):
        direct = _engine(serving, prompt, None, max_tokens=0, prompt_logprobs=1)
        assert choice.text == serving.app.state.server.tokenizer.decode(prompt)
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == len(prompt)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in direct.prompt_logprobs[1:]])
        assert choice.finish_reason == "length"
    plain = client.completions.create(model=NAME, prompt="abc", max_tokens=0, echo=True)
    assert plain.choices[0].text == "abc" and plain.choices[0].logprobs is None


def test_chat_logprobs_json_and_stream(server, client):
    serving, _ = server
    messages = [{"role": "user", "content": "Hi!"}]
    kwargs = dict(model="team/ad", messages=messages, max_completion_tokens=6, temperature=0, logprobs=True)
    out = client.chat.completions.create(**kwargs, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    template = serving.app.state.server.config.chat_template
    ids = serving.app.state.server.tokenizer.encode(template.render(messages), add_bos=not template.from_checkpoint)
    direct = _engine(serving, ids, "team/ad", max_tokens=6, logprobs=2, ignore_eos=True)
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in direct.logprobs], abs=1e-6)
    for entry, want in zip(content, direct.logprobs, strict=True):
        assert len(entry.top_logprobs) == 2  # bytes are the token's own (test_token_bytes), its text may be U+FFFD
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-6)
    chunks = list(
        client.chat.completions.create(**kwargs, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the stream's prompt is served from the prefix cache: the same tokens, logprobs within float rounding
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    no_top = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)
    assert client.chat.completions.create(**{**kwargs, "logprobs": False}).choices[0].logprobs is None


def test_penalties_bias_and_min_tokens_reach_the_engine(server, client):
    serving, _ = server
    forced = client.completions.create(model=NAME, prompt="x", max_tokens=4, temperature=0, logit_bias={"65": 100})
    assert forced.choices[0].text == "AAAA"
    eager_eos = {"logit_bias": {str(EOS): 100}}
    stopped = client.completions.create(model=NAME, prompt="x", max_tokens=8, temperature=0, extra_body=eager_eos)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(
        model=NAME, prompt="x", max_tokens=8, temperature=0, extra_body={**eager_eos, "min_tokens": 3}
    )
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    options = dict(presence_penalty=-2.0, frequency_penalty=-1.0)  # encourage repeats: a random model rarely repeats
    extra = {"repetition_penalty": 0.2, "ignore_eos": True}
    out = client.completions.create(
        model="team/ad", prompt="aaaa", max_tokens=8, temperature=0, **options, extra_body=extra
    )
    ids = serving.app.state.server.tokenizer.encode("aaaa")
    direct = _engine(serving, ids, "team/ad", max_tokens=8, repetition_penalty=0.2, ignore_eos=True, **options)
    plain = _engine(serving, ids, "team/ad", max_tokens=8, ignore_eos=True)
    assert out.choices[0].text == serving.app.state.server.tokenizer.decode(direct.result(timeout=0))
    assert direct.result(timeout=0) != plain.result(timeout=0)  # the options changed the greedy path
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0, logit_bias={"66": 100}
    )
    assert chat.choices[0].message.content == "BBB"


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", dict(logprobs=21), "logprobs"),
        ("completions", dict(logit_bias={"abc": 1}), "logit_bias"),
        ("completions", dict(logit_bias={"5": 101}), "logit_bias"),
        ("completions", dict(logit_bias={"99999": 1}), "logit_bias"),  # was param null: the defect fixed
        ("completions", dict(min_tokens=9, max_tokens=4), "min_tokens"),
        ("completions", dict(presence_penalty=3), "presence_penalty"),
        ("completions", dict(repetition_penalty=0), "repetition_penalty"),
        ("completions", dict(suffix="tail"), "suffix"),
        ("completions", dict(max_tokens=0), "max_tokens"),
        ("chat/completions", dict(top_logprobs=2), "top_logprobs"),
        ("chat/completions", dict(logprobs=True, top_logprobs=30), "top_logprobs"),
        ("chat/completions", dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ],
)
def test_bad_options_get_a_400_naming_the_parameter(server, route, body, param):
    base = {"model": NAME, "max_tokens": 2}
    base |= {"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    answer = httpx.post(f"{server[1].url}/v1/{route}", json={**base, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_stop_strings_count_from_min_tokens_on():
    def decode(min_tokens: int) -> str:
        decoder = TextDecoder(ByteTokenizer(CONFIG.vocab_size), ["\n"], min_tokens)
        text = ""
        for token in b"a\nb\nc":
            text += decoder.add(token)
            if decoder.stopped:
                return text
        return text + decoder.flush()

    assert decode(0) == "a"
    assert decode(3) == "a\nb"  # the first newline came before the 3rd token
    assert decode(5) == "a\nb\nc"
