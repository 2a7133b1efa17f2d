"""`adapter-manager demo`: the end-to-end demo's options (the demo itself is :mod:`runtime.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_exit import USAGE_ERROR, fail


def add_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="random bench-size Llama + synthetic adapters from the local hub, Zipf traffic through the server",
        description="Writes a random Llama and synthetic PEFT adapters of mixed ranks, serves them from the local "
        "hub, starts the server, registers every adapter by hub id through the admin API, sends requests with "
        "Zipf adapter popularity from concurrent clients and prints throughput, hit rates and swap latency.",
    )
    demo.add_argument("--adapters", type=int, default=64, help="synthetic adapters (default 64)")
    demo.add_argument("--requests", type=int, default=512, help="requests to send (default 512)")
    demo.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    demo.add_argument("--slots", type=int, default=8, help="device adapter slots (default 8)")
    demo.add_argument("--model", choices=("bench", "tiny"), default="bench", help="random model size (default bench)")
    demo.add_argument("--workdir", type=Path, default=None, help="where to write files (default: a temp dir)")
    demo.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="shard the model and the pool over N processes (1)"
    )
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    try:
        config = DemoConfig(
            args.adapters, args.requests, args.clients, args.slots, args.model,
            tensor_parallel_size=args.tensor_parallel_size,
        )  # fmt: skip
    except ValueError as err:
        return fail(USAGE_ERROR, err)
    return run_demo(config, args.workdir)
