"""What the local hub's tests steer and read: injected faults (statuses, delays, truncated bodies) and the log of the
requests it answered, shared by its request handlers."""

from __future__ import annotations

import fnmatch
import threading
from dataclasses import dataclass, field

from adapter_manager.sources.local_hub.layout import HubLayout


@dataclass(frozen=True)
class HubFault:
    """An injected failure for requests whose URL path matches `pattern` (fnmatch, query string excluded)."""

    pattern: str  # fnmatch pattern on the raw URL path, e.g. "*/resolve/*/adapter_model.safetensors"
    method: str | None = None  # "GET" or "HEAD" (the only methods served); None matches both
    status: int | None = None  # answer with this status (and an error body) instead of the real response
    delay_s: float = 0.0  # wait this long before answering (a client with a shorter timeout times out)
    truncate_at: int | None = None  # GET only: full Content-Length, but close at this file (or JSON body) offset
    times: int | None = None  # how many matching requests it applies to; None = forever
    error_code: str | None = None  # X-Error-Code sent with `status`, e.g. "RepoNotFound"; None sends none

    def __post_init__(self) -> None:
        if self.status is not None and not 100 <= self.status <= 599:
            raise ValueError(f"HubFault.status must be an HTTP status (100..599), got {self.status}")
        if self.delay_s < 0:
            raise ValueError(f"HubFault.delay_s must be >= 0, got {self.delay_s}")
        if self.truncate_at is not None and self.truncate_at < 0:
            raise ValueError(f"HubFault.truncate_at must be >= 0, got {self.truncate_at}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"HubFault.times must be >= 1 or None (forever), got {self.times}")
        if self.status is None and self.delay_s == 0 and self.truncate_at is None:
            raise ValueError(f"HubFault for {self.pattern!r} does nothing: set status, delay_s or truncate_at")

    def matches(self, method: str, path: str) -> bool:
        """True if this fault applies to a `method` request for URL path `path`."""
        if self.method is not None and self.method.upper() != method:
            return False
        if self.status is None and self.delay_s == 0 and method != "GET":
            return False  # a pure truncation only applies to requests with a body
        return fnmatch.fnmatchcase(path, self.pattern)


@dataclass(frozen=True)
class HubRequest:
    """One request the hub answered."""

    method: str  # "GET", "HEAD", ...
    path: str  # raw URL path, query string excluded
    status: int  # status answered; 0 if stop() interrupted a delay before any answer


@dataclass
class HubState:
    """What the request handlers share: the layout, the faults, the request log."""

    layout: HubLayout  # repo/revision lookup
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards faults and requests
    faults: list[tuple[HubFault, list[int | None]]] = field(default_factory=list)  # (fault, [remaining uses])
    requests: list[HubRequest] = field(default_factory=list)  # log, in answer order
    stopping: threading.Event = field(default_factory=threading.Event)  # set by stop(); ends delays early

    def take_fault(self, method: str, path: str) -> HubFault | None:
        with self.lock:
            for fault, remaining in self.faults:
                if remaining[0] != 0 and fault.matches(method, path):
                    if remaining[0] is not None:
                        remaining[0] -= 1
                    return fault
        return None

    def record(self, request: HubRequest) -> None:
        with self.lock:
            self.requests.append(request)
