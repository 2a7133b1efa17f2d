"""Each family's oracle: HF transformers (+ PeftModel) one adapter at a time, greedy tokens and prompt logprobs."""

from __future__ import annotations

import torch

from tests.runtime.families._models import WrittenFamily

PROMPTS = [[1, 5, 9, 3, 7, 11, 40, 2], [4, 60, 4, 33], [7, 1, 300, 12, 90, 91, 92, 93, 94, 95, 96, 97], [30, 31]]
NEW_TOKENS = 6


def requests(written: WrittenFamily) -> list[tuple[list[int], str | None]]:
    """Every prompt with the base and each adapter, interleaved so a batch mixes adapters and slots swap."""
    names = [None, *written.adapters]
    return [(prompt, names[(i + j) % len(names)]) for i, prompt in enumerate(PROMPTS) for j in range(2)]


@torch.no_grad()
def greedy(written: WrittenFamily, prompt: list[int], adapter: str | None) -> list[int]:
    """HF's greedy tokens after ``prompt`` (no eos), one forward per token over the whole sequence."""
    model, ids = written.oracle(adapter), list(prompt)
    for _ in range(NEW_TOKENS):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def prompt_logprobs(written: WrittenFamily, prompt: list[int], adapter: str | None) -> list[float]:
    """HF's log-probability of each prompt token after the first."""
    logits = written.oracle(adapter)(input_ids=torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]
