"""Adapter references and their resolution to local files: hub IDs through huggingface_hub, or local directories.

A ref is local when it starts with `/`, `./`, `../`, `~` or `file://`; anything else is a hub ID `org/name`,
optionally pinned `org/name@revision` (branch, tag or 40-hex sha). Hub downloads fetch only adapter_config.json and
adapter_model.safetensors into the HF cache (HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE and HF_ENDPOINT are honoured by
huggingface_hub itself; `HubConfig` overrides them per manager), through one `HfApi` on huggingface_hub's shared
session (one connection pool). A cold registration costs five requests: the revision's commit sha
(`HfApi.resolve_revision`; none for a sha), then a HEAD + GET per file pinned to that sha (none for a file already
cached). Transient failures (5xx, 429, timeouts, broken connections, truncated bodies) are retried with exponential
backoff, then raised as `HubUnavailableError`; a failed download leaves no partial blob in the cache.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, ResolvedRevision, constants, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.file_download import (
    REGEX_COMMIT_HASH,
    _cache_commit_hash_for_specific_revision,
    repo_folder_name,
)
from huggingface_hub.utils import tqdm as hf_tqdm

from ..errors import (
    AdapterAccessError,
    AdapterConfigError,
    AdapterNotFoundError,
    AdapterRevisionNotFoundError,
    CorruptWeightsError,
    HubUnavailableError,
    InvalidAdapterRefError,
    PickleRefusedError,
)
from .digests import FileDigests, content_digest
from .peft_format import CONFIG_NAME, PICKLE_SUFFIXES, WEIGHTS_NAME

log = logging.getLogger(__name__)

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"(?:{_NAME}/)?{_NAME}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_LOCAL_PREFIXES = ("/", "./", "../", "~", "file://")
_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


def is_local_ref(ref: str) -> bool:
    """Whether `ref` names a local directory rather than a hub repo, decided from its text alone."""
    return isinstance(ref, str) and ref.startswith(_LOCAL_PREFIXES)


@dataclass(frozen=True)
class AdapterRef:
    """Where an adapter comes from: a hub repository at an optional revision, or a local directory."""

    repo_id: str | None  # hub repository, e.g. "org/name"; None for a local directory
    revision: str | None  # branch, tag or sha as asked for; None = the hub's default branch
    path: Path | None  # resolved local directory; None for a hub ref

    @classmethod
    def parse(cls, ref: str) -> AdapterRef:
        if not isinstance(ref, str) or not ref.strip():
            raise InvalidAdapterRefError(str(ref), "empty adapter reference")
        if is_local_ref(ref):
            raw = ref.removeprefix("file://")
            if len(raw) > 4096 or any(ord(c) < 32 or c == "\x7f" for c in raw):
                raise InvalidAdapterRefError(ref, "a local path must be at most 4096 characters, with no control ones")
            return cls(repo_id=None, revision=None, path=Path(raw).expanduser().resolve())
        repo_id, _, revision = ref.partition("@")
        if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
            raise InvalidAdapterRefError(
                ref, "a hub ref must look like 'org/name' or 'org/name@revision' (local paths start with / or ./)"
            )
        if "@" in ref and (not _REVISION.fullmatch(revision) or ".." in revision or "//" in revision):
            raise InvalidAdapterRefError(ref, f"invalid revision {revision!r}")
        return cls(repo_id=repo_id, revision=revision or None, path=None)

    @property
    def is_local(self) -> bool:
        return self.path is not None

    def __str__(self) -> str:
        if self.path is not None:
            return str(self.path)
        return f"{self.repo_id}@{self.revision}" if self.revision else str(self.repo_id)


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of a resolved adapter on local disk, the revision they are and what they hold."""

    config_path: Path
    weights_path: Path
    sha: str  # hub commit sha; for a local dir "local-" + the first 40 hex of `digest`
    downloaded_bytes: int  # bytes fetched from the hub by this resolution (0 on a warm cache or a local dir)
    digest: str  # the adapter's identity: the digest of both files' content (`digests.content_digest`)

    def nbytes(self) -> int:
        """Both files' sizes on disk now."""
        return self.config_path.stat().st_size + self.weights_path.stat().st_size


@dataclass
class HubConfig:
    """How hub refs are fetched. None fields fall back to huggingface_hub's own env handling."""

    endpoint: str | None = None  # hub URL; None = HF_ENDPOINT or huggingface.co
    cache_dir: Path | None = None  # HF cache; None = HF_HUB_CACHE
    token: str | None = None  # None = HF_TOKEN or the saved login
    offline: bool = False  # never touch the network (HF_HUB_OFFLINE=1 has the same effect)
    retries: int = 3  # attempts after the first for transient failures
    backoff_s: float = 0.5  # first retry delay; doubles each retry
    timeout_s: float = 10.0  # per-request metadata timeout
    progress_bars: bool | None = None  # huggingface_hub's bars; None = only when stderr is a terminal

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise ValueError(
                f"retries ({self.retries}) and backoff_s ({self.backoff_s}) must be >= 0, "
                f"timeout_s ({self.timeout_s}) > 0"
            )


@dataclass
class HubResolver:
    """Resolves refs to local files. One download per repository at a time, so cleanup never races a download."""

    config: HubConfig = field(default_factory=HubConfig)
    _api: HfApi = field(init=False, repr=False)  # every hub call: config's endpoint and token, the shared session
    _locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _digests: FileDigests = field(default_factory=FileDigests, repr=False)

    def __post_init__(self) -> None:
        # huggingface_hub's user agent would otherwise ask {HF_ENDPOINT}/api/agent-harnesses (huggingface.co by
        # default) which agent runs it: traffic to a host other than this resolver's endpoint. Nothing else reads it.
        constants.HF_HUB_DISABLE_TELEMETRY = True
        self._api = HfApi(endpoint=self.config.endpoint, token=self.config.token)

    @property
    def cache_dir(self) -> Path:
        """The HF cache hub refs are downloaded into."""
        return Path(self.config.cache_dir or constants.HF_HUB_CACHE)

    @property
    def offline(self) -> bool:
        """Whether to use the HF cache alone: `HubConfig.offline` or HF_HUB_OFFLINE."""
        return self.config.offline or constants.is_offline_mode()

    def cached(self, repo_id: str, sha: str) -> AdapterFiles | None:
        """Both files of `repo_id` at commit `sha` from the HF cache alone (no network), or None if either is gone."""
        paths = [try_to_load_from_cache(repo_id, name, self.cache_dir, sha) for name in (CONFIG_NAME, WEIGHTS_NAME)]
        if not all(isinstance(path, str) for path in paths):
            return None
        return self._files(Path(paths[0]), Path(paths[1]), sha, 0)

    def resolve(self, ref: AdapterRef, adapter: str) -> AdapterFiles:
        if ref.path is not None:
            config, weights = _local_files(ref.path, adapter)
            digest = self.digest(config, weights)
            return AdapterFiles(config, weights, "local-" + digest[:40], 0, digest)
        assert ref.repo_id is not None
        with self._locks_guard:
            lock = self._locks.setdefault(ref.repo_id, threading.Lock())
        with lock:
            return self._download(ref, adapter)

    def _download(self, ref: AdapterRef, adapter: str) -> AdapterFiles:
        blobs = self.cache_dir / repo_folder_name(repo_id=ref.repo_id, repo_type="model") / "blobs"
        before = _blob_sizes(blobs)
        delay = self.config.backoff_s
        for attempt in range(self.config.retries + 1):
            try:
                sha, config, weights = self._fetch(ref)
                break
            except Exception as err:  # noqa: BLE001 - classified right below
                _remove_partial_blobs(blobs)
                error = _classify(err, ref, adapter)
                if error is not None:
                    raise error from err
                if attempt == self.config.retries:
                    raise HubUnavailableError(
                        adapter, f"hub kept failing for {ref} after {attempt + 1} attempts: {_describe(err)}"
                    ) from err
                log.warning("adapter %r: %s, retry %d in %.2fs", adapter, _describe(err), attempt + 1, delay)
                time.sleep(delay)
                delay *= 2
        downloaded = sum(size for name, size in _blob_sizes(blobs).items() if name not in before)
        if config is None:
            raise AdapterConfigError(adapter, f"{ref} has no {CONFIG_NAME} at revision {sha}")
        if weights is None:
            pickles = self._pickles(ref.repo_id, sha)
            if pickles:
                raise PickleRefusedError(
                    adapter, f"{ref} ships only pickle weights ({', '.join(pickles)}); need {WEIGHTS_NAME}"
                )
            raise CorruptWeightsError(adapter, f"{ref} has no {WEIGHTS_NAME} at revision {sha}")
        return self._files(config, weights, sha, downloaded)

    def digest(self, config: Path, weights: Path) -> str:
        """The content digest of an adapter's two files (hub blobs named by their sha256 are not read)."""
        return content_digest(self._digests.sha256(config), self._digests.sha256(weights))

    def _files(self, config: Path, weights: Path, sha: str, downloaded: int) -> AdapterFiles:
        return AdapterFiles(config, weights, sha, downloaded, self.digest(config, weights))

    def _fetch(self, ref: AdapterRef) -> tuple[str, Path | None, Path | None]:
        """The commit sha `ref` resolves to and its config and weights in the HF cache (None: not in that revision;
        the weights are not asked for without a config). Both files come from that one commit."""
        revision = self._resolve(ref)
        config = self._file(ref.repo_id, CONFIG_NAME, revision)
        weights = self._file(ref.repo_id, WEIGHTS_NAME, revision) if config is not None else None
        return revision.resolved, config, weights

    def _resolve(self, ref: AdapterRef) -> ResolvedRevision:
        """``ref``'s commit, as ``HfApi.resolve_revision`` finds it (a sha as it is; the hub's answer, recorded in the
        cache's refs; the cached one when the hub cannot be reached or offline), but asked with this resolver's
        ``timeout_s``: huggingface_hub's own call has none, so a hub that never answers would hang the caller."""

        def cached() -> ResolvedRevision:
            return self._api.resolve_revision(
                ref.repo_id, revision=ref.revision, cache_dir=self.config.cache_dir, local_files_only=True
            )

        if self.offline or (ref.revision is not None and REGEX_COMMIT_HASH.fullmatch(ref.revision)):
            return cached() if self.offline else ResolvedRevision(ref.revision, ref.revision, ref.repo_id, "model")
        try:
            sha = self._api.repo_info(ref.repo_id, revision=ref.revision, timeout=self.config.timeout_s).sha
        except (httpx2.TransportError, OfflineModeIsEnabled, HfHubHTTPError) as err:
            status = getattr(getattr(err, "response", None), "status_code", 500)
            if isinstance(err, httpx2.ProxyError) or status < 500:
                raise  # the hub answered (not found, no access), or a misconfigured proxy: not a reason to use a cache
            try:
                return cached()
            except RevisionResolutionError:
                raise err from None
        assert sha is not None, f"the hub's answer for {ref} has no sha"
        storage = Path(self.config.cache_dir or constants.HF_HUB_CACHE).expanduser().resolve()
        try:  # what resolve_revision records, so that an offline process finds this revision
            _cache_commit_hash_for_specific_revision(
                str(storage / repo_folder_name(repo_id=ref.repo_id, repo_type="model")),
                ref.revision or constants.DEFAULT_REVISION,
                sha,
            )
        except OSError as err:
            log.warning("could not record %s's commit %s in the cache: %s", ref, sha, err)
        return ResolvedRevision(sha, ref.revision, ref.repo_id, "model")

    def _file(self, repo_id: str, name: str, revision: str) -> Path | None:
        """One file of a resolved revision, downloaded unless cached; None if the hub says it is not there."""
        quiet = not (self.config.progress_bars if self.config.progress_bars is not None else sys.stderr.isatty())
        try:
            path = self._api.hf_hub_download(
                repo_id,
                name,
                revision=revision,
                cache_dir=self.config.cache_dir,
                local_files_only=self.offline,
                etag_timeout=self.config.timeout_s,
                tqdm_class=_NoProgress if quiet else None,
            )
        except RemoteEntryNotFoundError:
            return None
        return Path(path)

    def _pickles(self, repo_id: str, sha: str) -> list[str]:
        """Pickle weight files at a revision (asked only when the safetensors file is missing)."""
        if self.offline:
            return []
        try:
            return sorted(n for n in self._api.list_repo_files(repo_id, revision=sha) if n.endswith(PICKLE_SUFFIXES))
        except (HfHubHTTPError, httpx2.TransportError, OfflineModeIsEnabled):
            return []


class _NoProgress(hf_tqdm):
    """huggingface_hub's per-file download progress bar, switched off."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _classify(err: Exception, ref: AdapterRef, adapter: str) -> Exception | None:
    """The typed error for a final failure, or None when the failure is transient and worth a retry."""
    if isinstance(err, RevisionNotFoundError):
        return AdapterRevisionNotFoundError(adapter, f"{ref}: revision {ref.revision!r} not found on the hub")
    if isinstance(err, GatedRepoError):
        return AdapterAccessError(adapter, f"{ref} is gated: accept its terms and pass a token")
    status = _status(err)
    if isinstance(err, RepositoryNotFoundError) or status == 404:
        return AdapterNotFoundError(adapter, f"{ref}: repository not found on the hub (or private: check the token)")
    if status in (401, 403):
        return AdapterAccessError(adapter, f"{ref}: hub answered {status}; check the token")
    cause = err.__cause__ or err.__context__
    if isinstance(err, LocalEntryNotFoundError | RevisionResolutionError):
        if isinstance(cause, OfflineModeIsEnabled) or cause is None:
            return HubUnavailableError(adapter, f"{ref} is not in the local cache and the hub is offline")
        return _classify(cause, ref, adapter)
    if isinstance(err, OfflineModeIsEnabled):
        return HubUnavailableError(adapter, f"{ref} is not in the local cache and the hub is offline")
    if status in _RETRYABLE_STATUS or isinstance(err, httpx2.TransportError | OSError):
        return None
    if isinstance(err, HfHubHTTPError):
        return HubUnavailableError(adapter, f"{ref}: hub answered {status}: {err}")
    return None


def _status(err: Exception) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def _describe(err: Exception) -> str:
    status = _status(err)
    return f"HTTP {status}" if status else f"{type(err).__name__}: {err}".splitlines()[0]


def _blob_sizes(blobs: Path) -> dict[str, int]:
    try:
        return {e.name: e.stat().st_size for e in os.scandir(blobs) if e.is_file()}
    except FileNotFoundError:
        return {}


def _remove_partial_blobs(blobs: Path) -> None:
    for blob in blobs.glob("*.incomplete"):
        blob.unlink(missing_ok=True)


def _local_files(path: Path, adapter: str) -> tuple[Path, Path]:
    if not path.is_dir():
        raise AdapterNotFoundError(adapter, f"local adapter directory {path} does not exist")
    config, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not weights.is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise PickleRefusedError(adapter, f"{path} holds only pickle weights {pickles}; need {WEIGHTS_NAME}")
        raise CorruptWeightsError(adapter, f"{path} has no {WEIGHTS_NAME}")
    if not config.is_file():
        raise AdapterConfigError(adapter, f"{path} has no {CONFIG_NAME}")
    return config, weights
