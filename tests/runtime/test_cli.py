"""The `adapter-manager` command line, run as a user runs it: a real subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from huggingface_hub import snapshot_download

from adapter_manager import write_synthetic_adapter


def test_hub_serve_serves_a_folder_to_huggingface_hub(tmp_path, tiny_spec):
    write_synthetic_adapter(tmp_path / "hub" / "org" / "a", tiny_spec, r=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "hub", "serve", str(tmp_path / "hub"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "HF_ENDPOINT=http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        endpoint = line.strip().rsplit("HF_ENDPOINT=", 1)[1]
        folder = snapshot_download("org/a", endpoint=endpoint, cache_dir=tmp_path / "cache")
        assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_hub_serve_refuses_a_non_loopback_host(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "hub", "serve", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "loopback" in done.stderr


def test_demo_registers_adapters_from_the_local_hub(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "demo", "--adapters", "3", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert sum(line.startswith("demo/adapter-") for line in done.stdout.splitlines()) == 3
    assert "again: unchanged" in done.stdout and "file downloads from the hub: 6 before, 6 after" in done.stdout
