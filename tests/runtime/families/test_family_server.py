"""Every served family through the HTTP server and the official `openai` client, 3 adapters over 2 slots and
concurrent requests: each echoed completion's logprobs (prompt and greedy tokens) equal HF transformers + PEFT."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from adapter_manager import AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.families._oracle import NEW_TOKENS, greedy, requests
from tests.runtime.server.conftest import serving_on

TOL = 1e-4


@torch.no_grad()
def _sequence_logprobs(family, ids: list[int], adapter: str | None) -> list[float]:
    logits = family.oracle(adapter)(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_family_served_over_http_equals_transformers_and_peft(family) -> None:
    openai = pytest.importorskip("openai")
    adapters = {name: folder for name, (folder, _) in family.adapters.items()}
    with serving_on(
        family.folder,
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8)),
        EngineConfig(max_batch=4, max_seq_len=64, eos_ids=()),
        ServerConfig(model_name="base", port=0, max_pending=16),
        adapters,
    ) as (_, background):
        client = openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(request: tuple[list[int], str | None]) -> list[float | None]:
            prompt, adapter = request
            answer = client.completions.create(
                model=adapter or "base", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, echo=True, logprobs=0
            )
            return answer.choices[0].logprobs.token_logprobs

        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(complete, requests(family)))
    for (prompt, adapter), logprobs in zip(requests(family), served, strict=True):
        expected = _sequence_logprobs(family, prompt + greedy(family, prompt, adapter), adapter)
        assert logprobs[0] is None and len(logprobs) == len(expected) + 1, (family.name, prompt, adapter)
        gap = max(abs(a - b) for a, b in zip(logprobs[1:], expected, strict=True))
        assert gap <= TOL, (family.name, prompt, adapter, gap)
