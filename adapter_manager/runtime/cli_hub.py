"""`adapter-manager hub serve`: a folder of PEFT adapters served as a local Hugging Face Hub mirror."""

from __future__ import annotations

import argparse
from pathlib import Path

from adapter_manager.sources.local_hub import serve as serve_hub

from .cli_exit import OK, USAGE_ERROR, fail


def add_parser(commands: argparse._SubParsersAction) -> None:
    hub = commands.add_parser("hub", help="the local Hugging Face Hub mirror")
    hub_commands = hub.add_subparsers(dest="hub_command", required=True)
    serve = hub_commands.add_parser(
        "serve",
        help="serve a folder of PEFT adapters (<org>/<name>/ subfolders) over the hub HTTP API on loopback",
        description="Point huggingface_hub at it with HF_ENDPOINT=http://127.0.0.1:PORT. Stop with Ctrl-C or SIGTERM "
        "(exit 0).",
    )
    serve.add_argument("root", type=Path, help="folder holding <org>/<name>/ adapter repositories")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.root.is_dir():
        return fail(USAGE_ERROR, f"{args.root} is not a directory")

    def ready(url: str) -> None:
        print(f"serving {args.root}: HF_ENDPOINT={url}")

    try:
        serve_hub(args.root, args.host, args.port, on_ready=ready)
    except (ValueError, OSError) as err:
        return fail(USAGE_ERROR, err)
    return OK
