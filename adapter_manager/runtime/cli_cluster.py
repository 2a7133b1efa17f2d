"""`adapter-manager cluster serve`: the same API on Ray Serve, N engine replicas (the cluster extra)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from .cli_exit import OK, USAGE_ERROR, fail
from .cli_serve import model_folder
from .options import ServeOptions, add_serving_options


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        import ray.serve  # noqa: F401
    except ImportError as err:
        return fail(USAGE_ERROR, f"the cluster needs ray[serve]: pip install 'adapter-manager[cluster]' ({err})")
    with tempfile.TemporaryDirectory(prefix="adapter-manager-model-") as tmp:
        folder, name = model_folder(args, Path(tmp), lambda ref: Path(ref).resolve())
        return _run_cluster(args, folder, name)


def _run_cluster(args: argparse.Namespace, folder: Path, name: str) -> int:
    import signal
    import threading

    from .cluster import ClusterConfig, RayOptions, start_cluster, stop_cluster

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
        return fail(USAGE_ERROR, err)
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
