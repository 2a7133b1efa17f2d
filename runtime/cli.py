"""The `adapter-manager` command line: `hub serve DIR` (a local hub mirror) and `demo`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from adapter_manager.local_hub import serve as serve_hub

from .demo import run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adapter-manager", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    hub = commands.add_parser("hub", help="the local Hugging Face Hub mirror")
    hub_commands = hub.add_subparsers(dest="hub_command", required=True)
    serve = hub_commands.add_parser(
        "serve",
        help="serve a folder of PEFT adapters (<org>/<name>/ subfolders) over the hub HTTP API on loopback",
        description="Point huggingface_hub at it with HF_ENDPOINT=http://127.0.0.1:PORT.",
    )
    serve.add_argument("root", type=Path, help="folder holding <org>/<name>/ adapter repositories")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")

    demo = commands.add_parser(
        "demo", help="write synthetic adapters, serve them from the local hub, register them by hub ID, report"
    )
    demo.add_argument("--adapters", type=int, default=12, help="number of synthetic adapters (default 12)")
    demo.add_argument("--workdir", type=Path, default=None, help="where to write them (default: a temp dir)")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "hub":
        if not args.root.is_dir():
            print(f"error: {args.root} is not a directory", file=sys.stderr)
            return 2
        try:
            serve_hub(
                args.root, args.host, args.port, on_ready=lambda url: print(f"serving {args.root}: HF_ENDPOINT={url}")
            )
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    return run_demo(args.adapters, args.workdir)


if __name__ == "__main__":
    sys.exit(main())
