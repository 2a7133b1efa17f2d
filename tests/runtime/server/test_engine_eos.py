"""An eos id set only in EngineConfig.eos_ids ends a request like the tokenizer's own eos, and like it is no text."""

from __future__ import annotations

import pytest

from adapter_manager import AdapterManagerConfig
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.server.conftest import serving_on

EOS = ord("x")  # a plain byte token for the byte-level tokenizer: special only to the engine


@pytest.fixture(scope="module")
def eos_client(checkpoint_root):
    openai = pytest.importorskip("openai")
    with serving_on(
        checkpoint_root / "model",
        AdapterManagerConfig(max_slots=2, max_rank=16),
        EngineConfig(max_batch=4, max_seq_len=64, eos_ids=(EOS,)),
        ServerConfig(model_name="tiny", port=0),
    ) as (_, background):
        yield openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_the_engines_eos_ends_the_text_without_showing(eos_client, stream: bool) -> None:
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
    # generated on past it, and still no text: as the tokenizer's own eos under skip_special_tokens
    assert (ignored.choices[0].text, ignored.choices[0].finish_reason) == ("", "length")
    assert ignored.usage.completion_tokens == 8
