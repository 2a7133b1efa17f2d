"""The Serve application (ingress + adapter directory + engine replicas) and a local or remote Ray to run it on."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from .config import ClusterConfig
from .directory import AdapterDirectory
from .ingress import Ingress
from .replica import replica_class
from .router import AdapterRouter

log = logging.getLogger(__name__)

_SINGLE_MACHINE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def build_app(config: ClusterConfig) -> serve.Application:
    """Bind the three deployments: `config.replicas` engine replicas routed by `AdapterRouter` (or, with
    `multiplexed=False`, Serve's default router and no model ids), one directory, one ingress."""
    directory = serve.deployment(
        AdapterDirectory, name="AdapterDirectory", num_replicas=1, ray_actor_options={"num_cpus": 0}
    ).bind(state_dir=config.state_dir, max_pinned=config.pinned_slots)
    router = (
        RequestRouterConfig(
            request_router_class=AdapterRouter,
            request_router_kwargs={"spill_queue": config.spill_queue},
            request_routing_stats_period_s=config.stats_period_s,
        )
        if config.multiplexed and config.custom_router
        else RequestRouterConfig(request_routing_stats_period_s=config.stats_period_s)
    )
    replicas = serve.deployment(
        replica_class(config),
        name="EngineReplica",
        num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.replica_cpus},
        request_router_config=router,
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=5.0,
    ).bind(config, directory)
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(config, replicas, directory)


@dataclass(frozen=True)
class RayOptions:
    """Where the application runs: a new local Ray on loopback (address None) or an existing cluster."""

    address: str | None = None  # "auto", "ray://host:10001", ...; None: start a local Ray
    num_cpus: float | None = None  # local Ray only; None: the machine's
    host: str = "127.0.0.1"  # Serve's HTTP proxy
    port: int = 8000
    metrics_export_port: int | None = None  # local Ray only: Prometheus export of Ray, Serve and replica metrics


def start_cluster(config: ClusterConfig, options: RayOptions = RayOptions()) -> str:
    """Start (or connect to) Ray, start Serve's HTTP proxy and deploy the application; returns the base URL."""
    if not ray.is_initialized():
        if options.address is None:
            _keep_local_ray_on_loopback()
            kwargs = {"_metrics_export_port": options.metrics_export_port} if options.metrics_export_port else {}
            ray.init(
                num_cpus=options.num_cpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                **kwargs,
            )
        else:
            ray.init(address=options.address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": options.host, "port": options.port})
    serve.run(build_app(config), name=config.app_name, route_prefix=config.route_prefix)
    return f"http://{options.host}:{options.port}{config.route_prefix.rstrip('/')}"


def _keep_local_ray_on_loopback() -> None:
    """A Ray started here is one node on this machine: make it bind and talk on 127.0.0.1 only.

    On Linux Ray replaces a loopback node address with the machine's outward one and binds its servers on every
    interface. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is Ray's own switch for a single-machine Ray (its default on
    macOS and Windows): node address 127.0.0.1, every server bound to it. The processes Ray starts read it from the
    environment; this process read it when it imported ray, so its copy is set too (the one private name used here;
    tests/runtime/cluster checks every Ray socket is on loopback, so a Ray that renames it fails there)."""
    from ray._private import ray_constants

    os.environ[_SINGLE_MACHINE_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def stop_cluster(config: ClusterConfig, shutdown_ray: bool = True) -> None:
    """Delete the application; with `shutdown_ray` (a Ray this process started) stop Serve and Ray instead."""
    if shutdown_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(config.app_name)
