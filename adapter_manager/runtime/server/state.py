"""The HTTP server's config, and the objects its routes share for the app's lifetime."""

from __future__ import annotations

import hmac
import ipaddress
import time
from dataclasses import dataclass, field
from pathlib import Path

from adapter_manager import AdapterManager, AdapterRef, background_executor, is_local_ref

from ..engine.engine import Engine
from ..model.tokenizer import Tokenizer
from .chat_template import ChatTemplate
from .generation import Generator
from .http_errors import APIError

_MIB = 1 << 20


@dataclass
class ServerConfig:
    """How the server listens, whom it lets administer adapters, and how much it accepts."""

    model_name: str = "base"  # the base model's name in `model` fields and /v1/models
    host: str = "127.0.0.1"  # bind address; anything but loopback needs admin_token
    port: int = 8000  # 0 picks a free port
    admin_token: str | None = None  # bearer token for register / unregister / pin routes; None = open (loopback only)
    max_pending: int = 256  # generation requests in flight (queued or running); beyond it: 503
    max_body_bytes: int = 1 * _MIB  # largest request body; beyond it: 413
    default_chat_max_tokens: int = 256  # chat max_tokens when the client sends none (capped by the context left)
    register_workers: int = 2  # threads that download and prepare adapters, off the event loop
    chat_template: ChatTemplate = field(default_factory=ChatTemplate.default)  # messages -> prompt text
    local_roots: tuple[Path, ...] | None = None  # dirs the admin API may register from; None: no local paths

    def __post_init__(self) -> None:
        if self.local_roots is not None:
            self.local_roots = tuple(Path(root).expanduser().resolve() for root in self.local_roots)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_pending < 1 or self.max_body_bytes < 1024 or self.register_workers < 1:
            raise ValueError(
                f"max_pending ({self.max_pending}) and register_workers ({self.register_workers}) must be >= 1, "
                f"max_body_bytes ({self.max_body_bytes}) >= 1024"
            )
        if self.default_chat_max_tokens < 1:
            raise ValueError(f"default_chat_max_tokens must be >= 1, got {self.default_chat_max_tokens}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError(f"admin_token must be at least 8 characters, got {len(self.admin_token)}")
        if not _is_loopback(self.host) and self.admin_token is None:
            raise ValueError(f"binding {self.host!r} (not loopback) needs an admin_token for the admin routes")


class ServerState:
    """Engine, manager, tokenizer and the thread pools of one app."""

    def __init__(self, engine: Engine, manager: AdapterManager, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.engine = engine
        self.manager = manager
        self.tokenizer = tokenizer
        self.config = config
        self.started_at = time.time()
        self.generator = Generator(engine, tokenizer, config.max_pending)
        self.registrations = background_executor(config.register_workers, "register")

    def adapter_for(self, model: str) -> str | None:
        """`model` -> adapter id (None = the base model); raises APIError 404 when neither."""
        if model == self.config.model_name:
            return None
        if self.manager.is_registered(model):
            return model
        raise APIError(
            404, f"model {model!r} is neither the base model nor a registered adapter", "model", "model_not_found"
        )

    def check_admin(self, authorization: str | None) -> None:
        """Raise APIError 401 unless the bearer token matches (or no token is configured)."""
        token = self.config.admin_token
        if token is None:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(401, "admin routes need 'Authorization: Bearer <admin token>'", None, "unauthorized")

    def check_ref(self, ref: str, revision: str | None = None) -> None:
        """Validate a ref sent to the admin API from its text, before any file or network access: a hub id must
        parse; a local directory needs `local_roots` (`--local-root`) and must lie under one of them."""
        if not is_local_ref(ref):
            AdapterRef.parse(ref if revision is None else f"{ref}@{revision}")
            return
        if revision is not None:
            raise APIError(400, "a revision applies to hub ids only, not to a local directory", "revision")
        roots = self.config.local_roots
        if roots is None:
            raise APIError(
                403,
                f"registering a local directory ({ref}) over the API is disabled; start the server with "
                "--local-root DIR (ServerConfig.local_roots) to allow directories under DIR, or register a hub id",
                "ref",
                "local_paths_disabled",
            )
        path = AdapterRef.parse(ref).path
        if not any(path.is_relative_to(root) for root in roots):
            raise APIError(
                403,
                f"local path {path} is outside the allowed --local-root directories {[str(r) for r in roots]}",
                "ref",
                "outside_local_root",
            )

    def close(self) -> None:
        self.generator.close()
        self.registrations.shutdown(wait=False, cancel_futures=True)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
