"""SIGTERM stops the CLI with exit 0 from its first line on: while the interpreter still imports the commands' modules
(torch among them), before `serve` has printed anything."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.test_cli import _env, _ignore_sigint, _wait


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM now (its /proc status' caught-signals mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"SigCgt:\s*([0-9a-f]+)", status).group(1), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the caught-signals mask from /proc")
def test_sigterm_while_the_cli_still_imports_exits_0():
    proc = subprocess.Popen(
        [sys.executable, "-m", "adapter_manager.runtime.cli", "serve", "--random", "tiny", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_ignore_sigint,
    )
    try:
        deadline = time.monotonic() + 30
        while not _catches_sigterm(proc.pid):  # the CLI's first lines ran; its imports (over a second) now run
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGTERM)
    assert _wait(proc, 60) == 0
    assert proc.stdout.read() == ""  # stopped before `serve` said anything: during the imports
    assert "Traceback" not in proc.stderr.read()
