"""An eos id set only in EngineConfig.eos_ids ends a request like the tokenizer's own eos, and like it, the token that
stopped the request is no text; with ignore_eos it is the tokenizer's decode (skip_special_tokens), as vLLM gives it:
a token that is not one of the tokenizer's specials is text."""

from __future__ import annotations

import pytest

from adapter_manager import AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.server.conftest import serving_on

EOS = ord("x")  # a plain byte token for the byte-level tokenizer: special only to the engine


@pytest.fixture(scope="module")
def eos_client(checkpoint_root):
    openai = pytest.importorskip("openai")
    with serving_on(
        checkpoint_root / "model",
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=16)),
        EngineConfig(max_batch=4, max_seq_len=64, eos_ids=(EOS,)),
        ServerConfig(model_name="tiny", port=0),
    ) as (serving, background):
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, serving.app.state.server.tokenizer


@pytest.mark.parametrize("stream", [False, True])
def test_the_engines_eos_ends_the_text_without_showing(eos_client, stream: bool) -> None:
    eos_client, tokenizer = eos_client
    forced = {"logit_bias": {str(EOS): 100}}  # the first token is the engine's eos
    args = {"model": "tiny", "prompt": "ab", "max_tokens": 8, "temperature": 0, "stream": stream, **forced}
    if stream:
        chunks = list(eos_client.completions.create(**args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    else:
        choice = eos_client.completions.create(**args).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert (text, reason) == ("", "stop")
    ignored = eos_client.completions.create(**{**args, "stream": False, "extra_body": {"ignore_eos": True}})
    # generated on past it: 8 tokens, each the text the tokenizer gives it (it is not one of its special tokens)
    assert tokenizer.decode([EOS]) != "" and tokenizer.decode([tokenizer.eos_id]) == ""
    assert (ignored.choices[0].text, ignored.choices[0].finish_reason) == (tokenizer.decode([EOS] * 8), "length")
    assert ignored.usage.completion_tokens == 8
    # the tokenizer's own eos, generated past under ignore_eos, stays no text (skip_special_tokens)
    own = {"logit_bias": {str(tokenizer.eos_id): 100}, "extra_body": {"ignore_eos": True}}
    past = eos_client.completions.create(**{**args, **own, "stream": False})
    assert (past.choices[0].text, past.usage.completion_tokens) == ("", 8)
