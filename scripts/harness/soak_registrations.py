"""What the soak's admin calls should have left: per adapter id its version (the hub repo, the revision published
there, its commit sha, the digest the server reported), operator pins, and every change with the times its call
started and returned, so each answer can be judged against the version(s) current while it ran."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scripts.harness.soak_client import Answer


@dataclass(frozen=True)
class Version:
    """One content of an adapter: revision ``rev`` of hub repo ``repo`` (commit ``sha``)."""

    repo: str
    rev: int
    sha: str


@dataclass(frozen=True)
class Change:
    """An admin call that changed an adapter: ``before`` / ``after`` None = not registered."""

    adapter: str
    op: str
    start: float
    end: float
    before: Version | None
    after: Version | None


@dataclass
class Judgement:
    """Which versions an answer may come from: ``versions`` (None: not registered), whether a change of its adapter
    overlapped it, and whether it was sent after a change of content had returned."""

    versions: tuple[Version | None, ...]
    overlapped: bool
    after_refresh: bool
    previous: Version | None = None  # after a refresh: the content it replaced (a stale answer would be this one)


@dataclass
class Registrations:
    """The model the churn keeps. ``current``: id -> version; ``digests``: id -> the server's digest, where reported."""

    current: dict[str, Version] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    pinned: set[str] = field(default_factory=set)
    changes: dict[str, list[Change]] = field(default_factory=dict)
    revs: dict[str, int] = field(default_factory=dict)  # repo -> the newest revision published

    def register(self, adapter: str, version: Version, digest: str | None) -> None:
        """A registration before the soak (no change recorded: nothing was sent before it)."""
        self.current[adapter] = version
        if digest is not None:
            self.digests[adapter] = digest

    def change(
        self, adapter: str, op: str, start: float, end: float, after: Version | None, digest: str | None = None
    ) -> None:
        before = self.current.get(adapter)
        self.changes.setdefault(adapter, []).append(Change(adapter, op, start, end, before, after))
        if after is None:
            self.current.pop(adapter, None)
            self.digests.pop(adapter, None)
            self.pinned.discard(adapter)
        else:
            self.current[adapter] = after
            if digest is not None:
                self.digests[adapter] = digest
            elif before is not None and before.sha != after.sha:
                self.digests.pop(adapter, None)

    def next_rev(self, repo: str) -> int:
        self.revs[repo] = self.revs.get(repo, 0) + 1
        return self.revs[repo]

    def judge(self, answer: Answer, base: str) -> Judgement:
        """The versions `answer` may have been computed with (the base model: one version, never changed)."""
        if answer.model == base:
            return Judgement((Version(base, 0, ""),), False, False)
        changes = self.changes.get(answer.model, [])
        sent, done = answer.sent, answer.done if not math.isnan(answer.done) else math.inf
        before = [c for c in changes if c.end <= sent]
        during = [c for c in changes if c.end > sent and c.start < done]
        if before:
            first = before[-1].after
        elif during:
            first = during[0].before
        else:
            first = self.current.get(answer.model) if not changes else changes[0].before
        versions = (first, *(c.after for c in during))
        refreshes = [c for c in before if c.op in ("refresh", "load_inplace") and c.before != c.after]
        previous = refreshes[-1].before if refreshes and not during else None
        return Judgement(tuple(dict.fromkeys(versions)), bool(during), bool(refreshes) and not during, previous)
