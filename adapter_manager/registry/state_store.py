"""Durable registrations: one row per registered adapter in a sqlite3 database under a state directory, beside the
hub repositories the disk tier owns in each HF cache (so a restart still evicts the repos of adapters unregistered
before it).

    store = StateStore(Path("/var/lib/adapter-manager"))     # creates registrations.sqlite3 (WAL mode)
    store.put(Registration("org/a", "org/a", "v2", "3f2c...", pinned=False, registered_at=time.time()))
    store.load()                                              # every row, sorted by id
    store.set_owned(cache_dir, "org/a", True)                 # the disk tier downloads into org/a
    store.owned_repos(cache_dir)                              # {"org/a"}

Every write is one committed transaction before the call returns, so a caller that answers a client after `put` or
`delete` has made that answer durable. The journal is WAL with ``synchronous=FULL``: each commit fsyncs the WAL, so a
committed registration survives not only a killed process (which NORMAL already guarantees in WAL mode) but also a
power loss or kernel crash, where NORMAL may roll back the last commits. Registrations are rare and each one costs a
download and a preparation, so one fsync per commit costs nothing that matters.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

DB_NAME = "registrations.sqlite3"
_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS registrations (
    adapter_id    TEXT PRIMARY KEY,
    ref           TEXT NOT NULL,     -- hub repo id, or the resolved local directory
    revision      TEXT,              -- the revision asked for (None = the hub's default branch)
    sha           TEXT NOT NULL,     -- the resolved commit sha ("local-..." digest for a directory)
    pinned        INTEGER NOT NULL DEFAULT 0,
    registered_at REAL NOT NULL,
    digest        TEXT,              -- the content digest (NULL in a row written before it was recorded)
    config        TEXT,              -- adapter_config.json as registered (NULL: read from the files at restore)
    disk_bytes    INTEGER            -- its two files' bytes (what downloading them again reserves)
)
""",
    """
CREATE TABLE IF NOT EXISTS disk_owned (
    cache_dir     TEXT NOT NULL,     -- the HF cache, as an absolute path
    repo_id       TEXT NOT NULL,     -- a model repo this manager downloads into it (the disk tier may evict it)
    PRIMARY KEY (cache_dir, repo_id)
)
""",
)


@dataclass(frozen=True)
class Registration:
    """One durable registration."""

    adapter_id: str
    ref: str  # "org/name" for a hub repo, an absolute directory for a local adapter
    revision: str | None  # as registered (branch, tag or sha); None = default branch
    sha: str  # resolved commit sha the adapter is restored at
    pinned: bool  # operator pin, re-applied on restore
    registered_at: float  # time.time()
    digest: str | None = None  # the adapter's content digest; None in a row stored before digests were
    config: str | None = None  # its adapter_config.json text: a hub adapter whose files left the cache restores
    # from it without downloading them (they are fetched at first use); None in a row stored before it was
    disk_bytes: int | None = None  # its two files' bytes on disk (None: unknown)

    @property
    def is_local(self) -> bool:
        return self.ref.startswith("/")


@dataclass(frozen=True)
class UnrestoredAdapter:
    """A durable registration that could not be restored at start-up, and why."""

    registration: Registration
    error: str


class StateStore:
    """The registrations table of one state directory; thread-safe. `close()` when done."""

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / DB_NAME
        self._lock = threading.Lock()
        # isolation_level=None: every statement below is its own transaction, committed when execute returns.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise OSError(f"state store {self.path}: the file system refused WAL mode (journal_mode={mode})")
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA:
            self._db.execute(statement)
        columns = {name for _, name, *_ in self._db.execute("PRAGMA table_info(registrations)")}
        for column, kind in (("digest", "TEXT"), ("config", "TEXT"), ("disk_bytes", "INTEGER")):
            if column not in columns:  # a state directory from before the column (its rows keep NULL)
                self._db.execute(f"ALTER TABLE registrations ADD COLUMN {column} {kind}")

    def put(self, row: Registration, keep_pin: bool = True) -> None:
        """Insert or replace the registration of `row.adapter_id`; an update keeps a stored pin if `keep_pin`."""
        with self._lock:
            self._db.execute(
                "INSERT INTO registrations (adapter_id, ref, revision, sha, pinned, registered_at, digest, config, "
                "disk_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(adapter_id) DO UPDATE SET "
                "ref = excluded.ref, revision = excluded.revision, sha = excluded.sha, "
                "registered_at = excluded.registered_at, digest = excluded.digest, config = excluded.config, "
                "disk_bytes = excluded.disk_bytes, "
                "pinned = CASE WHEN ? THEN MAX(pinned, excluded.pinned) ELSE excluded.pinned END",
                (row.adapter_id, row.ref, row.revision, row.sha, int(row.pinned), row.registered_at, row.digest)
                + (row.config, row.disk_bytes, keep_pin),
            )

    def set_pinned(self, adapter_id: str, pinned: bool) -> None:
        with self._lock:
            self._db.execute("UPDATE registrations SET pinned = ? WHERE adapter_id = ?", (int(pinned), adapter_id))

    def delete(self, adapter_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM registrations WHERE adapter_id = ?", (adapter_id,))

    def load(self) -> list[Registration]:
        """Every registration, sorted by adapter id."""
        with self._lock:
            rows = self._db.execute(
                "SELECT adapter_id, ref, revision, sha, pinned, registered_at, digest, config, disk_bytes "
                "FROM registrations ORDER BY adapter_id"
            ).fetchall()
        return [Registration(a, ref, rev, sha, bool(p), *rest) for a, ref, rev, sha, p, *rest in rows]

    def owned_repos(self, cache_dir: Path) -> set[str]:
        """The repos the disk tier of `cache_dir` owns."""
        with self._lock:
            rows = self._db.execute("SELECT repo_id FROM disk_owned WHERE cache_dir = ?", (_key(cache_dir),))
            return {repo_id for (repo_id,) in rows.fetchall()}

    def set_owned(self, cache_dir: Path, repo_id: str, owned: bool) -> None:
        """Record (before the disk tier downloads into it) or forget (once it left the cache) an owned repo."""
        with self._lock:
            if owned:
                self._db.execute("INSERT OR IGNORE INTO disk_owned VALUES (?, ?)", (_key(cache_dir), repo_id))
            else:
                self._db.execute(
                    "DELETE FROM disk_owned WHERE cache_dir = ? AND repo_id = ?", (_key(cache_dir), repo_id)
                )

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _key(cache_dir: Path) -> str:
    return str(Path(cache_dir).resolve())
