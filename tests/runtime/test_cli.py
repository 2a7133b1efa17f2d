"""The `adapter-manager` command line, run as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import snapshot_download

from adapter_manager import write_synthetic_adapter
from adapter_manager.runtime.cli import main


def _ignore_sigint() -> None:
    """Launch a child as ``nohup cmd &`` does from a non-interactive shell: SIGINT ignored, inherited."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_hub_serve_serves_a_folder_to_huggingface_hub(tmp_path, tiny_spec):
    """Stopped by SIGTERM, although started ignoring SIGINT: exit 0."""
    write_synthetic_adapter(tmp_path / "hub" / "org" / "a", tiny_spec, r=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "adapter_manager.runtime.cli", "hub", "serve", str(tmp_path / "hub"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        line = proc.stdout.readline()
        assert "HF_ENDPOINT=http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        endpoint = line.strip().rsplit("HF_ENDPOINT=", 1)[1]
        folder = snapshot_download("org/a", endpoint=endpoint, cache_dir=tmp_path / "cache")
        assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert _wait(proc, 30) == 0, proc.stderr.read()


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """The child's exit code; a child still running after ``timeout`` is killed and fails the test."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        proc.kill()


def test_hub_serve_refuses_a_non_loopback_host(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "adapter_manager.runtime.cli", "hub", "serve", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "loopback" in done.stderr


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adapter_manager.runtime.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAPTER_MANAGER_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


@dataclass
class Ran:
    code: int
    out: str
    err: str


def in_process(capsys, *args: str) -> Ran:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return Ran(code, captured.out, captured.err)


def test_help_explains_every_command():
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("serve", "register", "list", "unregister", "metrics", "hub", "demo", "Exit codes"):
        assert command in top.stdout
    serve_help = run_cli("serve", "--help").stdout
    assert "--max-slots" in serve_help and "--admin-token" in serve_help and "127.0.0.1" in serve_help
    for option in ("--state-dir", "--disk-cache-bytes", "--local-root"):
        assert option in serve_help, option
    assert run_cli("serve").returncode == 2  # neither a model nor --random: usage error


def test_serve_then_register_list_metrics_unregister(tmp_path, capsys):
    """The server runs as a subprocess (started ignoring SIGINT, stopped by SIGTERM: exit 0); the client commands run
    in-process through `main` (same exit codes)."""
    from adapter_manager.runtime.model.config import LlamaConfig

    adapter = write_synthetic_adapter(tmp_path / "my-adapter", LlamaConfig.tiny().to_spec("random-tiny"), r=4)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adapter_manager.runtime.cli",
            "serve",
            "--random",
            "tiny",
            "--port",
            "0",
            "--pool-bytes",
            "256KiB",  # rows of 8 KiB: a zero row and three rank-8 blocks
            "--max-rank",
            "8",
            "--host-cache-bytes",
            "16MiB",
            "--admin-token",
            "cli-test-token",
            "--adapter",
            f"{adapter}=pre/loaded",
            "--workdir",
            str(tmp_path),
            "--local-root",
            str(tmp_path),  # the API may register directories under it
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_ignore_sigint,
    )
    try:
        assert proc.stdout.readline() == "loading a random tiny model\n"
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[0].startswith("registered pre/loaded"), lines
        assert " at http://127.0.0.1:" in lines[1], proc.stderr.read() if proc.poll() is not None else lines
        # dtype auto: the random checkpoint's float32; the layout measured on this machine (its env names none)
        assert re.search(r"; float32 weights, (blocked|onednn|plain) layout;", lines[1]), lines[1]
        url = lines[1].split(" at ", 1)[1].split()[0]
        auth = ("--url", url, "--admin-token", "cli-test-token")
        with urllib.request.urlopen(url + "/health", timeout=30) as response:
            assert json.loads(response.read())["slots"] == 3  # the pool was sized from --pool-bytes

        assert in_process(capsys, "register", f"{adapter}", "--id", "team/x", "--url", url).code == 2  # 401: no token
        registered = in_process(capsys, "register", str(adapter), "--id", "team/x", *auth)
        assert registered.code == 0 and registered.out.startswith("registered team/x"), registered.err
        listed = in_process(capsys, "list", "--url", url, "--json")
        assert listed.code == 0
        assert {a["id"] for a in json.loads(listed.out)} == {"pre/loaded", "team/x"}
        assert "team/x" in in_process(capsys, "list", "--url", url).out

        with urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", data=json.dumps({"model": "team/x", "prompt": "hi", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        ), timeout=60) as response:  # fmt: skip
            assert json.loads(response.read())["usage"]["completion_tokens"] >= 1
        metrics = in_process(capsys, "metrics", "--url", url)
        assert metrics.code == 0 and "host_to_slot" in metrics.out and "slot tier: hit rate" in metrics.out
        prometheus = in_process(capsys, "metrics", "--url", url, "--prometheus")
        assert "adapter_manager_move_seconds" in prometheus.out

        assert in_process(capsys, "unregister", "team/x", *auth).code == 0
        missing = in_process(capsys, "unregister", "team/x", *auth)
        assert missing.code == 2 and "404" in missing.err
    finally:
        proc.send_signal(signal.SIGTERM)
        assert _wait(proc, 60) == 0, proc.stderr.read()


def test_client_commands_exit_1_when_the_server_is_unreachable():
    done = run_cli("list", "--url", "http://127.0.0.1:9")
    assert done.returncode == 1 and "cannot reach the server" in done.stderr


def test_demo_small_run_prints_its_table(tmp_path):
    done = run_cli(
        "demo", "--model", "tiny", "--adapters", "6", "--requests", "40", "--clients", "4", "--slots", "2",
        "--workdir", str(tmp_path), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr  # the random model has a tokenizer: no byte-level fallback
    out = done.stdout
    assert "registered 6 adapters by hub id" in out and "40 ok, 0 failed" in out
    for row in ("throughput", "slot tier", "host tier", "stall", "hub_to_disk", "host_to_slot"):
        assert row in out, row


def test_a_random_model_is_served_with_a_tokenizer_of_its_own(tmp_path):
    from adapter_manager.runtime.cli import _parser
    from adapter_manager.runtime.cli_serve import model_folder
    from adapter_manager.runtime.model.tokenizer import HFTokenizer, load_tokenizer

    args = _parser().parse_args(["serve", "--random", "tiny"])
    folder, name = model_folder(args, tmp_path, resolve=Path)
    assert name == "random-tiny" and (folder / "config.json").is_file()
    tokenizer = load_tokenizer(folder, vocab_size=512)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.decode(tokenizer.encode("a\x01b")) == "a\x01b"


def test_serve_and_demo_say_the_librarys_long_steps_as_they_start(tmp_path, monkeypatch, capsys):
    """The kernels say a long step (compiling them, measuring the weight layouts) on the logger that `serve`,
    `cluster serve` and `demo` show: one bare line on stderr."""
    import logging

    import torch

    from adapter_manager.kernels.cpu import layout_choice
    from adapter_manager.runtime import cli

    progress = logging.getLogger(cli.PROGRESS_LOGGER)
    saved = (progress.handlers[:], progress.level, progress.propagate)
    progress.handlers.clear()
    monkeypatch.setattr(layout_choice, "_path", lambda: tmp_path / "weight_layouts.json")  # nothing cached: measure
    monkeypatch.delenv("ADAPTER_MANAGER_WEIGHT_LAYOUT", raising=False)
    try:
        cli._show_progress()
        cli._show_progress()  # one handler, however often main runs in a process
        capsys.readouterr()
        layout_choice.choose_layout(torch.float32, [(64, 64, 1)])
        err = capsys.readouterr().err
    finally:
        progress.handlers[:] = saved[0]
        progress.setLevel(saved[1])
        progress.propagate = saved[2]
    assert re.fullmatch(r"measuring the CPU weight layouts \(.*plain; once per machine and model shape\)\.\.\.\n", err)


def test_serve_sizes_the_engine_from_the_command_line(tmp_path):
    """--token-budget (vLLM's --max-num-batched-tokens), --max-batch and --max-seq-len reach the engine's config, for
    `serve` and for every replica of `cluster serve`."""
    from adapter_manager import TensorParallel
    from adapter_manager.runtime.cli import _parser
    from adapter_manager.runtime.options import ServeOptions

    sizes = ["--token-budget", "64", "--max-batch", "3", "--max-seq-len", "96"]
    (tmp_path / "config.json").write_text("{}")  # a checkpoint naming no dtype: auto serves float32
    for command, replica in ((["serve", "--random", "tiny"], False), (["cluster", "serve", "--random", "tiny"], True)):
        args = _parser().parse_args([*command, *sizes])
        engine = ServeOptions.from_args(args, "tiny", replica=replica).configs(tmp_path).engine
        assert (engine.scheduler.token_budget, engine.max_batch, engine.max_seq_len) == (64, 3, 96), command
        args = _parser().parse_args([*command, "--no-lora-vectors", "--lora-vocab"])
        manager = ServeOptions.from_args(args, "tiny", replica=replica).configs(tmp_path).manager
        assert not manager.rows.lora_vectors and manager.rows.lora_vocab
        xla = ["--device", "xla", "--tensor-parallel-size", "2", "--fully-sharded-loras"]
        options = ServeOptions.from_args(_parser().parse_args([*command, *xla]), "tiny", replica=replica)
        assert options.configs(tmp_path).manager.pool_config().rows.tensor_parallel == TensorParallel(2, True), command
    default = ServeOptions.from_args(_parser().parse_args(["serve", "--random", "tiny"]), "tiny").configs(tmp_path)
    assert default.engine.scheduler.token_budget == 512 and default.manager.rows.lora_vectors
    assert not default.manager.rows.lora_vocab and not default.manager.rows.tensor_parallel.fully_sharded_loras


def test_serve_dtype_auto_is_the_checkpoints(tmp_path):
    """--dtype auto (the default) serves in the checkpoint's torch_dtype, model and slots alike; a named dtype
    overrides it; auto without a checkpoint to read is refused."""
    import torch

    from adapter_manager.runtime.cli import _parser
    from adapter_manager.runtime.model.checkpoint import write_random_checkpoint
    from adapter_manager.runtime.model.config import LlamaConfig
    from adapter_manager.runtime.options import ServeOptions

    write_random_checkpoint(LlamaConfig.tiny(), tmp_path / "bf16", dtype=torch.bfloat16)
    write_random_checkpoint(LlamaConfig.tiny(), tmp_path / "fp32")

    def options(*extra: str) -> ServeOptions:
        return ServeOptions.from_args(_parser().parse_args(["serve", "model", *extra]), "model")

    auto = options().configs(tmp_path / "bf16")
    assert (auto.dtype, auto.manager.dtype) == (torch.bfloat16, torch.bfloat16)
    assert options().configs(tmp_path / "fp32").dtype == torch.float32
    assert options("--dtype", "float32").configs(tmp_path / "bf16").dtype == torch.float32
    cluster = ServeOptions.from_args(_parser().parse_args(["cluster", "serve", "m"]), "m", replica=True)
    assert cluster.configs(tmp_path / "bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="auto"):
        options().configs()


def test_serve_quantize_int8_serves_an_int8_base(tmp_path, capsys):
    """--quantize int8 reaches the loaded model (every block projection int8, the adapters' pool in the serving
    dtype) and it answers; the default keeps the weights as loaded; an unknown choice is a usage error."""
    import torch

    from adapter_manager.runtime.cli import _parser
    from adapter_manager.runtime.engine.sampling import SamplingParams
    from adapter_manager.runtime.model.checkpoint import write_random_checkpoint
    from adapter_manager.runtime.model.config import LlamaConfig
    from adapter_manager.runtime.options import ServeOptions
    from adapter_manager.runtime.server.launch import build_serving

    folder = write_random_checkpoint(LlamaConfig.tiny(), tmp_path / "fp32")

    def configs(*extra: str):
        return ServeOptions.from_args(_parser().parse_args(["serve", "model", *extra]), "model").configs(folder)

    assert configs().quantize is None
    int8 = configs("--quantize", "int8")
    assert int8.quantize == "int8"
    serving = build_serving(folder, int8.manager, int8.engine, int8.server, int8.dtype, quantize=int8.quantize)
    try:
        model = serving.engine.model
        assert model.weight_layout == "int8" and int8.manager.dtype == torch.float32
        handle = serving.engine.submit([1, 2, 3], None, SamplingParams(max_tokens=3, ignore_eos=True))
        serving.engine.run_until_idle(max_steps=50)
        assert len(handle.result(timeout=0)) == 3
    finally:
        serving.close()
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "model", "--quantize", "int4"])
    capsys.readouterr()


def test_sigterm_while_the_model_loads_stops_serve_with_exit_0(tmp_path):
    """SIGTERM is a stop from the moment `serve` starts, not only once it listens: sent as soon as it says it is
    loading, the process exits 0 (not -15) and leaves no scratch folder behind in its --workdir."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "adapter_manager.runtime.cli",
            "serve",
            "--random",
            "tiny",
            "--port",
            "0",
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=_ignore_sigint,
    )
    try:
        assert proc.stdout.readline() == "loading a random tiny model\n"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert _wait(proc, 60) == 0, proc.stderr.read()
