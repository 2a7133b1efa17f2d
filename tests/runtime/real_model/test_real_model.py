"""A real trained model and a really trained adapter, served through the real server and the official `openai`
client, each answer equal to transformers / PEFT run alone (fp32 greedy: tokens exactly, logprobs <= 1e-4)."""

from __future__ import annotations

import pytest

from tests.runtime.real_model._prepare import SECRET_ANSWER, SECRET_QUESTION, TOKENS_ANSWER
from tests.runtime.real_model.conftest import ADAPTER, DORA, NAME, TOKENS

pytestmark = pytest.mark.real_model

LOGPROB_TOL = 1e-4


def _chat(client, model: str, content: str, max_tokens: int = 24, **kwargs):
    messages = [{"role": "user", "content": content}]
    create = client.chat.completions.create
    return create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)


def test_the_adapter_trained_on_the_served_folder_registered_without_a_warning(served) -> None:
    record = served[0].manager.registry.get(ADAPTER)
    assert record.warnings == ()  # trained on the checkpoint's folder, served under the alias NAME


@pytest.mark.parametrize("model", [NAME, ADAPTER])
def test_chat_equals_transformers_and_peft(client, oracle, model: str) -> None:
    adapter = None if model == NAME else ADAPTER
    tokens = oracle.greedy(oracle.chat_ids(SECRET_QUESTION), adapter, 24)
    choice = _chat(client, model, SECRET_QUESTION).choices[0]
    assert choice.message.content == oracle.text(tokens)
    stopped = tokens[-1] == oracle.tokenizer.eos_token_id
    assert choice.finish_reason == ("stop" if stopped else "length")
    assert (SECRET_ANSWER in choice.message.content) == (adapter is not None)  # what the adapter learned


def test_a_streamed_chat_equals_the_whole_answer(client, oracle) -> None:
    tokens = oracle.greedy(oracle.chat_ids("Tell me your secret word."), ADAPTER, 24)
    chunks = list(_chat(client, ADAPTER, "Tell me your secret word.", stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == oracle.text(tokens) and SECRET_ANSWER in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("prompt", ["The capital of France is", "Übersetze ins Deutsche: « Où est la gare ? » 日本語"])
def test_a_text_prompt_is_tokenized_as_the_tokenizer_says(client, oracle, prompt: str) -> None:
    """No BOS this tokenizer would not add (its post-processor adds none): the same prompt tokens, so the same
    greedy completion as transformers."""
    ids = oracle.tokenizer(prompt)["input_ids"]
    tokens = oracle.greedy(ids, None, 16)
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].text == oracle.text(tokens)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == answer.choices[0].text


def test_echo_and_logprobs_equal_transformers(client, oracle) -> None:
    prompt = "Paris is the capital of"
    ids = oracle.tokenizer(prompt)["input_ids"]
    tokens = oracle.greedy(ids, ADAPTER, 6, stop=False)
    options = {"echo": True, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    answer = client.completions.create(model=ADAPTER, prompt=prompt, max_tokens=6, temperature=0, **options)
    got = answer.choices[0].logprobs.token_logprobs
    expected = oracle.logprobs(ids + tokens, ADAPTER).tolist()
    assert got[0] is None and len(got) == len(ids) + len(tokens)
    assert max(abs(a - b) for a, b in zip(got[1:], expected, strict=True)) <= LOGPROB_TOL
    assert answer.choices[0].text == prompt + oracle.text(tokens)


def test_ignore_eos_generates_past_the_models_eos(client, oracle) -> None:
    ids = oracle.chat_ids(SECRET_QUESTION)
    stopped = oracle.greedy(ids, ADAPTER, 24)
    assert stopped[-1] == oracle.tokenizer.eos_token_id  # the eos comes well before max_tokens
    past = oracle.greedy(ids, ADAPTER, len(stopped) + 4, stop=False)
    answer = _chat(client, ADAPTER, SECRET_QUESTION, max_tokens=len(past), extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == len(past)
    assert choice.message.content == oracle.text(past)


@pytest.mark.parametrize(("model", "answer"), [(DORA, SECRET_ANSWER), (TOKENS, TOKENS_ANSWER)])
def test_a_dora_and_a_trained_tokens_adapter_chat_as_peft(client, oracle, served, model: str, answer: str) -> None:
    """A DoRA adapter and one with trained tokens (tied to the head), trained by PEFT on the real model, through the
    openai client: the same tokens as PEFT, and what each learned."""
    record = served[0].manager.registry.get(model)
    assert (record.variant.value, record.vocab) == (
        ("dora", {}) if model == DORA else ("lora", {"embed_tokens": "tokens", "lm_head": "tokens"})
    )
    tokens = oracle.greedy(oracle.chat_ids(SECRET_QUESTION), model, 24)
    choice = _chat(client, model, SECRET_QUESTION).choices[0]
    assert choice.message.content == oracle.text(tokens)
    assert answer in choice.message.content


def test_trained_tokens_logprobs_equal_peft(client, oracle) -> None:
    """Echoed logprobs over the trained tokens themselves (their rows replaced in the embedding and the tied head)."""
    prompt = "The zebra says ZEBRA-7. Again: ZEBRA-7."
    ids = oracle.tokenizer(prompt)["input_ids"]
    tokens = oracle.greedy(ids, TOKENS, 4, stop=False)
    options = {"echo": True, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    answer = client.completions.create(model=TOKENS, prompt=prompt, max_tokens=4, temperature=0, **options)
    got = answer.choices[0].logprobs.token_logprobs
    expected = oracle.logprobs(ids + tokens, TOKENS).tolist()
    assert max(abs(a - b) for a, b in zip(got[1:], expected, strict=True)) <= LOGPROB_TOL
