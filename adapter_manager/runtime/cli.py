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
import contextlib
import json
import logging
import sys
import tempfile
from pathlib import Path

from adapter_manager.sources.local_hub import serve as serve_hub

from .cli_args import add_serving_options, parse_bytes
from .client import DEFAULT_URL, TOKEN_ENV, URL_ENV, ServerClient, ServerError

OK, SERVER_ERROR, USAGE_ERROR = 0, 1, 2
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adapter-manager", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_cluster(commands)

    def client_command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--url", default=None, help=f"server URL (default ${URL_ENV} or {DEFAULT_URL})")
        sub.add_argument("--admin-token", default=None, help=f"bearer token for admin routes (default ${TOKEN_ENV})")
        sub.add_argument("--json", action="store_true", help="print the server's JSON answer")
        return sub

    register = client_command("register", "register an adapter on a running server")
    register.add_argument("ref", help="hub id org/name[@revision], or a local directory (starts with / or ./)")
    register.add_argument("--id", default=None, help="adapter id to serve it under (default: the repo id or dir name)")
    register.add_argument("--revision", default=None, help="hub branch, tag or commit sha")
    register.add_argument("--pin", action="store_true", help="keep it resident in a device slot")
    client_command("list", "list a running server's adapters")
    unregister = client_command("unregister", "unregister an adapter from a running server")
    unregister.add_argument("adapter_id")
    metrics = client_command("metrics", "swap latency per tier, hit rates, evictions and stall")
    metrics.add_argument("--prometheus", action="store_true", help="print the Prometheus text of /metrics")

    hub = commands.add_parser("hub", help="the local Hugging Face Hub mirror")
    hub_commands = hub.add_subparsers(dest="hub_command", required=True)
    hub_serve = hub_commands.add_parser(
        "serve",
        help="serve a folder of PEFT adapters (<org>/<name>/ subfolders) over the hub HTTP API on loopback",
        description="Point huggingface_hub at it with HF_ENDPOINT=http://127.0.0.1:PORT. Stop with Ctrl-C or SIGTERM "
        "(exit 0).",
    )
    hub_serve.add_argument("root", type=Path, help="folder holding <org>/<name>/ adapter repositories")
    hub_serve.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    hub_serve.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")

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
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a model with the OpenAI-compatible API, adapter admin API and metrics",
        description="Load a Llama checkpoint (HF format, safetensors) and serve /v1/completions, "
        "/v1/chat/completions, /v1/models, the adapter admin API (/v1/adapters), vLLM's /v1/load_lora_adapter, "
        "/metrics and /health. Stop with Ctrl-C or SIGTERM (exit 0).",
    )
    add_serving_options(serve, replica=False)
    serve.add_argument(
        "--pool-bytes", type=parse_bytes, default=None, help="size the adapter pool in bytes instead, e.g. 1GiB"
    )
    serve.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="serving dtype (auto: the checkpoint's torch_dtype, float32 where it names none)",
    )
    serve.add_argument(
        "--quantize",
        choices=("none", "int8"),
        default="none",
        help="int8: hold the base model's projection weights (and an untied lm_head) weight-only int8, one scale "
        "per output row; adapters stay in the serving dtype",
    )
    serve.add_argument("--max-pending", type=int, default=256, help="requests in flight before 503 (default 256)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; others need a token)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="REF[=ID]",
        help="register at start-up (repeatable): hub id or local directory, optionally =the id to serve it as",
    )
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep registrations durably in DIR (sqlite3) and restore them at start from the HF cache, offline",
    )
    serve.add_argument(
        "--disk-cache-bytes",
        type=parse_bytes,
        default=None,
        help="bound the adapter files in the HF cache, e.g. 10GiB (least recently used revisions evicted)",
    )
    serve.add_argument("--workdir", type=Path, default=None, help="with --random: where to write it (default: temp)")


def _add_cluster(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser("cluster", help="serve on Ray Serve (the cluster extra: pip install '.[cluster]')")
    cluster_commands = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    serve = cluster_commands.add_parser(
        "serve",
        help="serve a model on N Ray Serve replicas, each with its own adapter pool",
        description="Start a local Ray on 127.0.0.1 (or join --address) and serve the same OpenAI API and adapter "
        "admin API through Serve's ingress; the `model` field is Serve's multiplexed model id. Stop with Ctrl-C.",
    )
    add_serving_options(serve, replica=True)
    serve.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    serve.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto); default: a local Ray")
    serve.add_argument("--num-cpus", type=float, default=None, help="local Ray's CPUs (default: the machine's)")
    serve.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (default 1)")
    serve.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1 (default 8000)")
    serve.add_argument("--metrics-port", type=int, default=None, help="local Ray: Prometheus export port")
    serve.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the cluster's registrations durably in DIR (sqlite3, on the directory's node); replicas register "
        "them again lazily from the HF cache",
    )
    serve.add_argument(
        "--pinned-slots",
        type=int,
        default=0,
        help="slots per replica kept for operator pins (a pinned adapter is held on every replica; default 0: none)",
    )
    serve.add_argument("--no-multiplex", action="store_true", help="no model ids: Serve's default routing (baseline)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "hub":
        return _hub(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "cluster":
        return _cluster_serve(args)
    if args.command == "demo":
        from .demo import DemoConfig, run_demo

        try:
            config = DemoConfig(args.adapters, args.requests, args.clients, args.slots, args.model)
        except ValueError as err:
            return _fail(USAGE_ERROR, err)
        return run_demo(config, args.workdir)
    return _client(args)


def _hub(args: argparse.Namespace) -> int:
    if not args.root.is_dir():
        return _fail(USAGE_ERROR, f"{args.root} is not a directory")
    try:
        serve_hub(
            args.root, args.host, args.port, on_ready=lambda url: print(f"serving {args.root}: HF_ENDPOINT={url}")
        )
    except (ValueError, OSError) as err:
        return _fail(USAGE_ERROR, err)
    return OK


def _serve(args: argparse.Namespace) -> int:
    _stop_on_sigterm()  # now, not once serving: a SIGTERM while the model loads is a stop too (exit 0)
    try:
        print(f"loading {args.model or f'a random {args.random} model'}", flush=True)
        return _load_and_serve(args)
    except KeyboardInterrupt:  # SIGINT / SIGTERM before the server was up (serve() handles its own)
        print("stopped before serving", flush=True)
        return OK


def _load_and_serve(args: argparse.Namespace) -> int:
    from .model.checkpoint import CheckpointError, CheckpointSource
    from .options import ServeOptions, model_source
    from .server.app import serve
    from .server.launch import build_serving

    try:
        # a temp dir only without --workdir: a killed server cannot remove one, and would leave it behind
        scratch = tempfile.TemporaryDirectory(prefix="adapter-manager-model-") if args.workdir is None else None
        with scratch or contextlib.nullcontext(str(args.workdir)) as tmp:
            folder, name = model_source(args, Path(tmp), lambda ref: CheckpointSource(ref).resolve())
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
                mode, model = serving.engine.decode_mode, serving.engine.model
                weights = f"{str(model.dtype).removeprefix('torch.')} weights, {model.weight_layout} layout"

                def ready(url: str) -> None:
                    line = f"serving {name} at {url} (OpenAI API: {url}/v1; {weights}; decode steps: {mode})"
                    print(line, flush=True)

                serve(serving.app, on_ready=ready)
            finally:
                serving.close()
    except (ValueError, OSError, CheckpointError, LookupError) as err:
        return _fail(USAGE_ERROR, err)
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
    unrestored = manager.registry.unrestored()
    if manager.restored or unrestored:
        print(f"restored {len(manager.restored)} adapters from the state directory ({len(unrestored)} failed)")
    for failed in unrestored:
        print(f"warning: {failed.registration.adapter_id} not restored: {failed.error}", file=sys.stderr)


def _cluster_serve(args: argparse.Namespace) -> int:
    try:
        import ray.serve  # noqa: F401
    except ImportError as err:
        return _fail(USAGE_ERROR, f"the cluster needs ray[serve]: pip install 'adapter-manager[cluster]' ({err})")
    from .options import model_source

    with tempfile.TemporaryDirectory(prefix="adapter-manager-model-") as tmp:
        folder, name = model_source(args, Path(tmp), lambda ref: Path(ref).resolve())
        return _run_cluster(args, folder, name)


def _run_cluster(args: argparse.Namespace, folder: Path, name: str) -> int:
    import signal
    import threading

    from .cluster import ClusterConfig, RayOptions, start_cluster, stop_cluster
    from .options import ServeOptions

    try:
        configs = ServeOptions.from_args(args, name, replica=True).configs(folder)
        config = ClusterConfig(
            folder,
            configs.manager,
            configs.engine,
            configs.server,
            dtype=configs.dtype,
            replicas=args.replicas,
            replica_cpus=args.replica_cpus,
            multiplexed=not args.no_multiplex,
            pinned_slots=args.pinned_slots,
            state_dir=args.state_dir,
        )
        if not config.folder.is_dir():
            raise ValueError(f"{config.folder} is not a checkpoint directory")
        options = RayOptions(args.address, args.num_cpus, port=args.port, metrics_export_port=args.metrics_port)
    except ValueError as err:
        return _fail(USAGE_ERROR, err)
    url = start_cluster(config, options)
    print(f"serving {config.server.model_name} on {args.replicas} replicas at {url} (OpenAI API: {url}/v1)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_cluster(config, shutdown_ray=args.address is None)
    return OK


def _client(args: argparse.Namespace) -> int:
    try:
        with ServerClient(args.url, args.admin_token) as client:
            if args.command == "register":
                answer = client.register(args.ref, args.id, args.revision, args.pin)
                text = f"{answer['action']} {answer['id']} sha {answer['sha']} rank {answer['rank']} ({answer['tier']})"
            elif args.command == "unregister":
                answer = client.unregister(args.adapter_id)
                text = f"unregistered {answer['id']}"
            elif args.command == "list":
                answer = client.adapters()
                text = _adapter_table(answer)
            elif args.prometheus:
                print(client.prometheus(), end="")
                return OK
            else:
                answer = client.swaps()
                text = _metrics_table(answer)
    except ServerError as err:
        return _fail(SERVER_ERROR if err.status == 0 or err.status >= 500 else USAGE_ERROR, err)
    print(json.dumps(answer, indent=2) if args.json else text)
    return OK


def _adapter_table(adapters: list[dict]) -> str:
    lines = [f"{'id':40} {'rank':>4} {'MB':>7} {'tier':5} {'slot':>4} {'pinned':6} sha"]
    for a in adapters:
        slot = "" if a["slot"] is None else str(a["slot"])
        tier = a["tier"] or a["status"]
        lines.append(
            f"{a['id']:40} {a['rank'] or 0:4d} {a['bytes'] / 1e6:7.2f} {tier:5} {slot:>4} "
            f"{'yes' if a['pinned'] else '':6} {a['sha'][:12]}"
        )
    return "\n".join(lines)


def _metrics_table(snapshot: dict) -> str:
    lines = [f"{'move':14} {'count':>6} {'MB':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}"]
    for move, s in sorted(snapshot["moves"].items()):
        ms = " ".join(f"{s[k] * 1e3:8.2f}" for k in ("p50_s", "p95_s", "p99_s", "max_s"))
        lines.append(f"{move:14} {s['count']:6d} {s['total_bytes'] / 1e6:9.2f} {ms}")
    for tier in sorted(set(snapshot["hits"]) | set(snapshot["misses"])):
        hits, misses = snapshot["hits"].get(tier, 0), snapshot["misses"].get(tier, 0)
        rate = snapshot["hit_rates"].get(tier, 0.0)
        evictions = snapshot["evictions"].get(tier, 0)
        lines.append(f"{tier} tier: hit rate {rate:.1%} ({hits} hits, {misses} misses), {evictions} evictions")
    for name, what in (("stall", "steps blocked on moves"), ("adapter_wait", "requests waiting for their adapter")):
        wait = snapshot.get(name)
        if wait:
            lines.append(
                f"{name.replace('_', ' ')}: {wait['count']} {what}, total {wait['total_seconds']:.3f}s, "
                f"p50 {wait['p50_s'] * 1e3:.2f} ms, p99 {wait['p99_s'] * 1e3:.2f} ms, max {wait['max_s'] * 1e3:.2f} ms"
            )
    kv = snapshot.get("kv")
    if kv:
        lines.append(
            f"kv cache: {kv['blocks_used']} / {kv['blocks_total']} blocks used, {kv['blocks_cached']} cached, "
            f"{kv['block_size']} tokens each; prefix hit rate {kv['prefix_hit_rate']:.1%} "
            f"({kv['prefix_hit_tokens']} of {kv['prefix_queried_tokens']} tokens, {kv['prefix_hit_requests']} of "
            f"{kv['prefix_queried_requests']} requests), {kv['preemptions']} preemptions"
        )
    return "\n".join(lines)


def _fail(code: int, err: object) -> int:
    print(f"error: {err}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
