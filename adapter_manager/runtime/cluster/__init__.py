"""Scale-out on Ray Serve (the `cluster` extra): engine replicas, each with its own adapter pool, behind Serve's
FastAPI ingress; the OpenAI `model` field is Serve's multiplexed model id, routed by `AdapterRouter`."""

from .app import RayOptions, build_app, start_cluster, stop_cluster
from .config import ClusterConfig
from .directory import AdapterDirectory, DirectoryEntry
from .router import AdapterRouter

__all__ = [
    "AdapterDirectory",
    "AdapterRouter",
    "ClusterConfig",
    "DirectoryEntry",
    "RayOptions",
    "build_app",
    "start_cluster",
    "stop_cluster",
]
