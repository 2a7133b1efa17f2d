"""`adapter-manager serve`: load a model and serve the OpenAI-compatible API, the adapter admin API and metrics."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .cli_exit import OK, USAGE_ERROR, fail
from .options import ServeOptions, add_serving_options, model_source


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model with the OpenAI-compatible API, adapter admin API and metrics",
        description="Load a Llama checkpoint (HF format, safetensors) and serve /v1/completions, "
        "/v1/chat/completions, /v1/models, the adapter admin API (/v1/adapters), vLLM's /v1/load_lora_adapter, "
        "/metrics and /health. Stop with Ctrl-C or SIGTERM (exit 0).",
    )
    add_serving_options(serve, replica=False)  # with the serve-only ones: --pool-bytes, --dtype, --port, ...
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="REF[=ID]",
        help="register at start-up (repeatable): hub id or local directory, optionally =the id to serve it as",
    )
    serve.add_argument("--workdir", type=Path, default=None, help="with --random: where to write it (default: temp)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    _stop_on_sigterm()  # now, not once serving: a SIGTERM while the model loads is a stop too (exit 0)
    try:
        print(f"loading {args.model or f'a random {args.random} model'}", flush=True)
        return _load_and_serve(args)
    except KeyboardInterrupt:  # SIGINT / SIGTERM before the server was up (serve() handles its own)
        print("stopped before serving", flush=True)
        return OK


def model_folder(args: argparse.Namespace, random_root: Path, resolve: Callable[[str], Path]) -> tuple[Path, str]:
    """The checkpoint folder and the base model's name, as :func:`runtime.options.model_source` gives them; a
    ``--random`` model gets a tokenizer of its own beside its weights (not the byte-level fallback)."""
    from .model.config import LlamaConfig
    from .model.tokenizer import write_byte_level_tokenizer

    folder, name = model_source(args, random_root, resolve)
    if args.random:
        write_byte_level_tokenizer(folder, LlamaConfig.from_hf(folder))
    return folder, name


def _load_and_serve(args: argparse.Namespace) -> int:
    from .model.checkpoint import CheckpointError, CheckpointSource
    from .server.app import serve
    from .server.launch import build_serving

    try:
        # a temp dir only without --workdir: a killed server cannot remove one, and would leave it behind
        scratch = tempfile.TemporaryDirectory(prefix="adapter-manager-model-") if args.workdir is None else None
        with scratch or contextlib.nullcontext(str(args.workdir)) as tmp:
            folder, name = model_folder(args, Path(tmp), lambda ref: CheckpointSource(ref).resolve())
            configs = ServeOptions.from_args(args, name).configs(folder)
            serving = build_serving(
                folder,
                configs.manager,
                configs.engine,
                configs.server,
                dtype=configs.dtype,
                model_ref=args.model,
                quantize=configs.quantize,
            )
            _print_restored(serving.manager)
            for spec in args.adapter:
                ref, _, adapter_id = spec.partition("=")
                result = serving.manager.register(ref, adapter_id or None)
                print(f"registered {result.record.adapter_id} ({result.record.sha[:12]}, rank {result.record.rank})")
            try:
                mode = serving.engine.decode_mode
                model = serving.engine.model
                weights = f"{str(model.dtype).removeprefix('torch.')} weights, {model.weight_layout} layout"

                def ready(url: str) -> None:
                    line = f"serving {name} at {url} (OpenAI API: {url}/v1; {weights}; decode steps: {mode})"
                    print(line, flush=True)

                serve(serving.app, on_ready=ready)
            finally:
                serving.close()
    except (ValueError, OSError, CheckpointError, LookupError) as err:
        return fail(USAGE_ERROR, err)
    return OK


def _stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does: a stop, not a kill."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _print_restored(manager) -> None:
    unrestored = manager.unrestored()
    if manager.restored or unrestored:
        print(f"restored {len(manager.restored)} adapters from the state directory ({len(unrestored)} failed)")
    for failed in unrestored:
        print(f"warning: {failed.registration.adapter_id} not restored: {failed.error}", file=sys.stderr)
