"""The real-model lane's fixtures: SmolLM2-135M-Instruct and an adapter trained on it (``_prepare``, cached per
machine), served by the real server, an official `openai` client, and the transformers / PEFT oracle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from adapter_manager import AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.real_model._prepare import prepared, prepared_variants
from tests.runtime.server.conftest import serving_on

pytestmark = pytest.mark.real_model

NAME = "smol"  # the served name: an alias, not the checkpoint's folder
ADAPTER = "secret"
DORA, TOKENS = "secret-dora", "zebra-tokens"  # a DoRA adapter, one with trained tokens (`_prepare`)


@pytest.fixture(scope="session")
def real_model() -> tuple:
    pytest.importorskip("peft")
    pytest.importorskip("gguf", reason="the dev extra's gguf reads the model's GGUF file")
    return prepared()


@pytest.fixture(scope="session")
def real_variants(real_model) -> dict[str, object]:
    """{DORA: folder, TOKENS: folder}."""
    folders = prepared_variants()
    return {DORA: folders["dora"], TOKENS: folders["tokens"]}


@dataclass
class Oracle:
    """transformers (and PEFT for the adapter), fp32, greedy: the tokens and log-probabilities to match."""

    tokenizer: object
    base: object
    adapted: object
    others: dict[str, object]  # the variant adapters' PeftModels by served name

    def model(self, adapter: str | None):
        return self.base if adapter is None else self.adapted if adapter == ADAPTER else self.others[adapter]

    def chat_ids(self, content: str) -> list[int]:
        messages = [{"role": "user", "content": content}]
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(encoded["input_ids"])

    @torch.no_grad()
    def greedy(self, ids: Sequence[int], adapter: str | None, max_new: int, stop: bool = True) -> list[int]:
        """Greedy tokens after ``ids``, ending at the eos (kept) unless ``stop`` is False."""
        model, out = self.model(adapter), list(ids)
        for _ in range(max_new):
            token = int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax())
            out.append(token)
            if stop and token == self.tokenizer.eos_token_id:
                break
        return out[len(ids) :]

    @torch.no_grad()
    def logprobs(self, ids: Sequence[int], adapter: str | None) -> torch.Tensor:
        """log p(ids[t] | ids[:t]) for t >= 1. Shape: [len(ids) - 1]."""
        logits = self.model(adapter)(input_ids=torch.tensor([list(ids)])).logits[0].double()
        return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    def text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="session")
def oracle(real_model, real_variants) -> Oracle:
    import peft
    from transformers import AutoTokenizer, LlamaForCausalLM

    model_dir, adapter_dir = real_model

    def peft_model(folder):  # noqa: ANN001, ANN202
        return peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(model_dir), folder).eval()

    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    others = {name: peft_model(folder) for name, folder in real_variants.items()}
    return Oracle(AutoTokenizer.from_pretrained(model_dir), base, peft_model(adapter_dir), others)


@pytest.fixture(scope="module")
def served(real_model, real_variants):
    """The real server on the checkpoint, under the alias NAME, with the trained adapter registered as ADAPTER and
    the variants as DORA and TOKENS (three adapters, two slots; the vocabulary columns on)."""
    model_dir, adapter_dir = real_model
    with serving_on(
        model_dir,
        AdapterManagerConfig(max_slots=2, rows=RowOptions(max_rank=8, lora_vocab=True), base_model_mismatch="refuse"),
        EngineConfig(max_batch=4, max_seq_len=512),
        ServerConfig(model_name=NAME, port=0, max_pending=16),
        adapters={ADAPTER: adapter_dir, **real_variants},
    ) as started:
        yield started


@pytest.fixture
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=120)
