"""The cluster's config: how many replicas, what each replica runs, and how requests are routed to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapter_manager import AdapterManagerConfig

from ..engine.engine import EngineConfig
from ..server.state import ServerConfig


@dataclass
class ClusterConfig:
    """One Serve application: an ingress, an adapter directory and `replicas` engine replicas of `folder`."""

    folder: Path  # the HF checkpoint every replica loads
    manager: AdapterManagerConfig = field(default_factory=AdapterManagerConfig)  # each replica's own pool
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)  # model_name, admin_token, max_pending, body limit
    dtype: torch.dtype = torch.float32
    replicas: int = 2  # engine replicas (each: one Engine + its own AdapterManager)
    replica_cpus: float = 1.0  # Ray CPUs reserved per replica
    max_ongoing_requests: int = 64  # per replica, Serve's admission limit (<= server.max_pending)
    multiplexed: bool = True  # False: no multiplexed model id, Serve's default routing (the benchmark's baseline)
    custom_router: bool = True  # False: model ids with Serve's own multiplexed routing (power of two choices)
    spill_queue: int = 4  # a resident adapter spreads once its holders run this many more requests than another
    stats_period_s: float = 1.0  # how often replicas report free capacity and adapter heat to the router
    spare_slots: int = 1  # pool slots kept out of Serve's model count: an adapter Serve unloads while requests for
    # it still run keeps its slot until they end, and the next load takes the spare slot instead of waiting
    pinned_slots: int = 0  # pool slots per replica kept for operator pins: a pinned adapter is held in a slot on
    # every replica (out of Serve's model count) and its requests go to the shortest queue; 0 refuses pins
    state_dir: Path | None = None  # the directory's registrations, durable (sqlite3) on the node it runs on
    app_name: str = "adapter-manager"
    route_prefix: str = "/"

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if self.state_dir is not None:
            self.state_dir = Path(self.state_dir).resolve()
        if not isinstance(self.manager.max_slots, int):
            raise ValueError(
                f"the cluster needs an integer max_slots (Serve's models per replica follow it), "
                f"got {self.manager.max_slots!r}"
            )
        if self.replicas < 1 or self.max_ongoing_requests < 1 or self.spill_queue < 1:
            raise ValueError(
                f"replicas ({self.replicas}), max_ongoing_requests ({self.max_ongoing_requests}) and "
                f"spill_queue ({self.spill_queue}) must be >= 1"
            )
        if self.max_ongoing_requests > self.server.max_pending:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) exceeds the replica server's max_pending "
                f"({self.server.max_pending})"
            )
        if self.spare_slots < 0 or self.pinned_slots < 0 or self.models_per_replica < 1:
            raise ValueError(
                f"spare_slots ({self.spare_slots}) and pinned_slots ({self.pinned_slots}) must be >= 0 and leave "
                f"Serve at least one of max_slots ({self.manager.max_slots})"
            )
        if self.replica_cpus <= 0 or self.stats_period_s <= 0:
            raise ValueError(
                f"replica_cpus ({self.replica_cpus}) and stats_period_s ({self.stats_period_s}) must be > 0"
            )

    @property
    def models_per_replica(self) -> int:
        """Serve's `max_num_models_per_replica`: the adapters the pool holds at max rank less the spare and the
        pinned slots, so every one Serve keeps loaded can be pinned at once, beside the operator's pins and the ones
        still answering after Serve unloaded them."""
        return int(self.manager.max_slots) - self.spare_slots - self.pinned_slots
