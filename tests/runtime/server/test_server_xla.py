"""The server on the torch_xla CPU device (XLA lane): built, it has compiled every step graph, so its first requests
(a completion, an echo scoring its prompt, a chat) compile nothing."""

from __future__ import annotations

import pytest

from adapter_manager import AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.engine.scheduler import SchedulerConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.server.conftest import NAME, serving_on

pytestmark = pytest.mark.xla
torch_xla = pytest.importorskip("torch_xla")
openai = pytest.importorskip("openai")

import torch_xla.debug.metrics as metrics  # noqa: E402


def compile_count() -> int:
    data = metrics.metric_data("CompileTime")
    return 0 if data is None else data[0]


def test_a_built_server_compiles_nothing_on_its_first_requests(checkpoint_root):
    engine = EngineConfig(max_batch=2, max_seq_len=32, token_buckets=(8, 16), scheduler=SchedulerConfig(16))
    with serving_on(
        checkpoint_root / "model",
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8), device="xla"),
        engine,
        ServerConfig(model_name=NAME, port=0, max_pending=8),
    ) as (_, background):
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        warmed = compile_count()
        assert warmed > 0  # the warm-up compiled the step graphs
        client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0)
        client.completions.create(model=NAME, prompt="hi there", max_tokens=1, echo=True, logprobs=1)
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert compile_count() == warmed
