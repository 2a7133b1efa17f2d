"""vLLM's CPU backend as the peer: its environment, and a peer-side script (``vllm_peer.py``, ``vllm_same.py``: files
run by the peer venv's python, where the project is not installed) run on a JSON job, its one result line parsed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

PEER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2"}


def peer_env() -> dict[str, str]:
    """This process's environment for a vLLM process: PEER_ENV set, our PYTHONPATH dropped."""
    env = {**os.environ, **PEER_ENV}
    env.pop("PYTHONPATH", None)
    return env


def run_peer(python: str, script: str, job: Path, timeout_s: float = 3000) -> dict:
    """Run ``scripts/harness/<script>`` with the peer's ``python`` on the JSON file ``job``; returns the JSON of its
    ``PEER_RESULT`` line. SystemExit with the tail of its stderr when it fails."""
    path = Path(__file__).with_name(script)  # run as a file: the project is not installed there
    # -P: the script's folder stays off sys.path, or the harness's profile.py hides the standard library's (which
    # torch's dynamo imports through cProfile)
    argv = [python, "-P", str(path), str(job)]
    proc = subprocess.run(argv, env=peer_env(), capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEER_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("PEER_RESULT "))
