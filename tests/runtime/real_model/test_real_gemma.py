"""A real non-Llama model: Gemma 3 270M (q/k norms, sandwich norms, GeGLU, a scaled and tied 262k embedding, 5 local
layers of their own RoPE base to each global one) and a LoRA adapter trained on it by PEFT, served through the real
server and the official `openai` client: completions equal transformers / PEFT run alone (fp32 greedy: tokens
exactly, logprobs <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from adapter_manager import AdapterManagerConfig, RowOptions
from adapter_manager.runtime.engine.engine import EngineConfig
from adapter_manager.runtime.server.state import ServerConfig
from tests.runtime.real_model._prepare_gemma import ANSWER, PROMPT, prepared_gemma
from tests.runtime.server.conftest import serving_on

pytestmark = pytest.mark.real_model
LOGPROB_TOL = 1e-4
NAME, ADAPTER = "gemma", "secret"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("peft")
    pytest.importorskip("gguf", reason="the dev extra's gguf reads the model's GGUF file")
    return prepared_gemma()


@pytest.fixture(scope="module")
def oracle(gemma):
    import peft
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    model_dir, adapter_dir = gemma
    base = Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(Gemma3ForCausalLM.from_pretrained(model_dir), adapter_dir).eval()
    return AutoTokenizer.from_pretrained(model_dir), {None: base, ADAPTER: adapted}


@pytest.fixture(scope="module")
def client(gemma):
    openai = pytest.importorskip("openai")
    model_dir, adapter_dir = gemma
    with serving_on(
        model_dir,
        AdapterManagerConfig(max_slots=1, rows=RowOptions(max_rank=8), base_model_mismatch="refuse"),
        EngineConfig(max_batch=4, max_seq_len=512),  # the local layers' window: every context fits it
        ServerConfig(model_name=NAME, port=0, max_pending=16),
        adapters={ADAPTER: adapter_dir},
    ) as (_, background):
        yield openai.OpenAI(base_url=background.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@torch.no_grad()
def _greedy_and_logprobs(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """NEW_TOKENS greedy tokens after ``ids`` (past the eos) and the logprob of every token after the first."""
    out = list(ids)
    for _ in range(NEW_TOKENS):
        out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    logits = model(input_ids=torch.tensor([out])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(out[1:])[:, None])[:, 0]
    return out[len(ids) :], logprobs.tolist()


@pytest.mark.parametrize("model", [NAME, ADAPTER])
def test_completion_equals_transformers_and_peft(client, oracle, model: str) -> None:
    tokenizer, models = oracle
    adapter = None if model == NAME else ADAPTER
    ids = tokenizer(PROMPT)["input_ids"]
    tokens, expected = _greedy_and_logprobs(models[adapter], ids)
    options = {"echo": True, "logprobs": 0, "extra_body": {"ignore_eos": True}}
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, **options)
    choice = answer.choices[0]
    assert choice.text == PROMPT + tokenizer.decode(tokens, skip_special_tokens=True)
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids) + NEW_TOKENS
    assert max(abs(a - b) for a, b in zip(got[1:], expected, strict=True)) <= LOGPROB_TOL
    assert (ANSWER.strip() in choice.text) == (adapter is not None)  # what the adapter learned
