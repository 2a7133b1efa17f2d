"""adapter-manager: serve many LoRA adapters on one base Llama through a fixed pool of device slots.

Commands:
  serve       load a model and serve the OpenAI-compatible API, the adapter admin API and metrics
  register    register an adapter (hub id or local directory) on a running server
  list        list a running server's adapters and where each lives (slot, host, disk)
  unregister  unregister an adapter from a running server
  metrics     swap latency, hit rates, evictions and stall of a running server
  hub serve   serve a folder of PEFT adapters as a local Hugging Face Hub mirror
  cluster serve  the same API on Ray Serve: N engine replicas, requests routed to where the adapter is
  demo        the end-to-end demo: 64 adapters, 8 slots, Zipf traffic through a running server

Exit codes: 0 ok, 1 the server failed or could not be reached, 2 bad usage or input (including 4xx answers).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path


def _exit_while_starting(signum: int, frame: object) -> None:
    """SIGTERM before a command has set up anything (its modules, torch among them, still importing): exit 0."""
    os._exit(0)


# Run as the program (the `adapter-manager` script, or `python -m`): a SIGTERM from here on is a stop, exit 0, not a
# kill mid-import. The package roots load their names lazily, so this line runs before torch is imported.
if __name__ == "__main__" or Path(sys.argv[0]).name == "adapter-manager":
    signal.signal(signal.SIGTERM, _exit_while_starting)

from . import cli_admin, cli_cluster, cli_demo, cli_hub, cli_serve  # noqa: E402 - after the SIGTERM handler
from .cli_exit import OK, SERVER_ERROR, USAGE_ERROR  # noqa: E402

__all__ = ["OK", "SERVER_ERROR", "USAGE_ERROR", "main"]

PROGRESS_LOGGER = "adapter_manager.progress"
"""Where the library says a long step as it starts (compiling the CPU kernels, measuring the weight layouts)."""
_LOADING_COMMANDS = ("serve", "cluster", "demo")  # the commands that load a model: they show the long steps


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adapter-manager", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_serve.add_parser(commands)
    cli_cluster.add_parser(commands)
    cli_admin.add_parsers(commands)
    cli_hub.add_parser(commands)
    cli_demo.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "serve" and signal.getsignal(signal.SIGTERM) is _exit_while_starting:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # serve replaces it with its own stop; the others as before
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command in _LOADING_COMMANDS:
        _show_progress()
    return args.run(args)


def _show_progress() -> None:
    """The library's long steps, one line each on stderr as they start (INFO of :data:`PROGRESS_LOGGER`)."""
    progress = logging.getLogger(PROGRESS_LOGGER)
    if not progress.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        progress.addHandler(handler)
    progress.setLevel(logging.INFO)
    progress.propagate = False


if __name__ == "__main__":
    sys.exit(main())
