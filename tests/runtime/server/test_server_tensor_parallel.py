"""`serve --tensor-parallel-size 2` on CPU: the server's process is rank 0 and starts the other shard's process; a
real OpenAI client gets the same greedy tokens and logprobs (within 1e-4) from it as from `serve` unsharded, for the
base model and an adapter, and SIGTERM stops both processes with exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from adapter_manager import write_synthetic_adapter
from tests.runtime.test_cli import _env, _ignore_sigint, _wait

openai = pytest.importorskip("openai")


def _serve(tmp_path, adapter, tp: int) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable, "-m", "adapter_manager.runtime.cli", "serve", "--random", "tiny", "--port", "0",
        "--max-rank", "8", "--max-slots", "2", "--adapter", f"{adapter}=team/a", "--workdir", str(tmp_path / f"tp{tp}"),
        "--tensor-parallel-size", str(tp), "--max-seq-len", "64",
    ]  # fmt: skip
    (tmp_path / f"tp{tp}").mkdir()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), preexec_fn=_ignore_sigint
    )
    for _ in range(3):  # "loading ...", "registered ...", "serving ... at URL ..."
        line = proc.stdout.readline()
        if " at http://127.0.0.1:" in line:
            return proc, line.split(" at ", 1)[1].split()[0]
    proc.kill()
    raise AssertionError(proc.stderr.read())


def test_a_two_shard_server_answers_as_the_unsharded_one(tmp_path):
    from adapter_manager.runtime.model.config import LlamaConfig

    adapter = write_synthetic_adapter(tmp_path / "adapter", LlamaConfig.tiny().to_spec("random-tiny"), r=4)
    answers, procs = {}, []
    try:
        for tp in (1, 2):
            proc, url = _serve(tmp_path, adapter, tp)
            procs.append(proc)
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
            answers[tp] = [
                client.completions.create(
                    model=model, prompt="hello there", max_tokens=8, temperature=0, logprobs=1, seed=0
                ).choices[0]
                for model in ("random-tiny", "team/a")
            ]
        for one, two in zip(answers[1], answers[2], strict=True):
            assert one.text == two.text and one.logprobs.tokens == two.logprobs.tokens
            assert (
                max(abs(a - b) for a, b in zip(one.logprobs.token_logprobs, two.logprobs.token_logprobs, strict=True))
                < 1e-4
            )
        assert answers[1][0].text != answers[1][1].text  # the adapter changed the answer: its rows were used
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert _wait(proc, 60) == 0, proc.stderr.read()
