"""The local hub against the real, unmodified huggingface_hub client (each test with its own cache dir)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")
httpx2 = pytest.importorskip("httpx2")

from huggingface_hub import HfApi, hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub import constants as hf_constants  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from adapter_manager.sources.local_hub import HubFault, LocalHub  # noqa: E402

REPO = "org/adapter"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
ADAPTER_FILES = [CONFIG, WEIGHTS]
MAIN_WEIGHTS = bytes(range(256)) * 256  # 64 KiB


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    hub_root = tmp_path / "hub"
    repo = hub_root / "org" / "adapter"
    _write(repo / CONFIG, json.dumps({"peft_type": "LORA", "r": 8}))
    _write(repo / WEIGHTS, MAIN_WEIGHTS)
    _write(repo / "README.md", "# adapter\n")
    _write(repo / "sub" / "notes.txt", "nested\n")
    for rev, r in (("v1", 4), ("dev", 16)):
        _write(repo / ".revisions" / rev / CONFIG, json.dumps({"peft_type": "LORA", "r": r}))
        _write(repo / ".revisions" / rev / WEIGHTS, bytes([r]) * 1024)
    _write(tmp_path / "secret.txt", "TOP-SECRET")
    (repo / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (hub_root / "org" / "linked").symlink_to(tmp_path)
    return hub_root


@pytest.fixture
def hub(root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with LocalHub(root) as running:
        yield running


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """huggingface_hub's retry back-off sleeps, recorded instead of slept (the hub itself never calls time.sleep)."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def _api(hub: LocalHub) -> HfApi:
    return HfApi(endpoint=hub.endpoint, token=False)


def _snapshot(hub: LocalHub, cache: Path, **kwargs: object) -> Path:
    return Path(snapshot_download(REPO, cache_dir=cache, endpoint=hub.endpoint, token=False, **kwargs))


def _download(hub: LocalHub, cache: Path, filename: str = WEIGHTS, **kwargs: object) -> Path:
    return Path(hf_hub_download(REPO, filename, cache_dir=cache, endpoint=hub.endpoint, token=False, **kwargs))


def _raw(hub: LocalHub, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(hub.endpoint.removeprefix("http://"), timeout=5)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _cached_files(cache: Path) -> list[str]:
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file() and ".locks" not in p.parts)


def test_snapshot_download_allow_patterns_matches_model_info(hub: LocalHub, root: Path, tmp_path: Path) -> None:
    folder = _snapshot(hub, tmp_path / "cache", allow_patterns=ADAPTER_FILES)
    info = _api(hub).model_info(REPO)
    assert folder.name == info.sha and len(info.sha) == 40
    assert sorted(p.name for p in folder.iterdir()) == ADAPTER_FILES
    assert (folder / WEIGHTS).read_bytes() == MAIN_WEIGHTS
    assert info.id == REPO and info.private is False
    assert [s.rfilename for s in info.siblings] == ["README.md", CONFIG, WEIGHTS, "sub/notes.txt"]
    downloads = sorted(r.path.rsplit("/", 1)[1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path)
    assert downloads == ADAPTER_FILES


def test_list_repo_files_skips_revisions_and_symlinks(hub: LocalHub) -> None:
    api = _api(hub)
    assert api.list_repo_files(REPO) == ["README.md", CONFIG, WEIGHTS, "sub/notes.txt"]
    assert api.list_repo_files(REPO, revision="v1") == ADAPTER_FILES
    top = {(e.path, type(e).__name__) for e in api.list_repo_tree(REPO)}
    assert ("sub", "RepoFolder") in top and ("sub/notes.txt", "RepoFile") not in top
    sizes = {s.rfilename: s.size for s in api.model_info(REPO, files_metadata=True).siblings}
    assert sizes[WEIGHTS] == len(MAIN_WEIGHTS)


@pytest.mark.parametrize("rev", ["v1", "dev"])
def test_revision_by_name_and_by_sha(hub: LocalHub, tmp_path: Path, rev: str) -> None:
    by_name = _snapshot(hub, tmp_path / "cache", revision=rev, allow_patterns=ADAPTER_FILES)
    sha = _api(hub).model_info(REPO, revision=rev).sha
    assert by_name.name == sha != _api(hub).model_info(REPO).sha
    assert json.loads((by_name / CONFIG).read_text())["r"] == {"v1": 4, "dev": 16}[rev]
    by_sha = _snapshot(hub, tmp_path / "other-cache", revision=sha, allow_patterns=ADAPTER_FILES)
    assert by_sha.name == sha and (by_sha / WEIGHTS).read_bytes() == (by_name / WEIGHTS).read_bytes()
    assert _api(hub).model_info(REPO, revision=sha).sha == sha


def test_editing_a_file_changes_the_sha(hub: LocalHub, root: Path, tmp_path: Path) -> None:
    old = _snapshot(hub, tmp_path / "cache", allow_patterns=ADAPTER_FILES)
    _write(root / "org" / "adapter" / CONFIG, json.dumps({"peft_type": "LORA", "r": 9}))
    new = _snapshot(hub, tmp_path / "cache", allow_patterns=ADAPTER_FILES)
    assert new.name != old.name and new.name == _api(hub).model_info(REPO).sha
    assert json.loads((new / CONFIG).read_text())["r"] == 9
    with pytest.raises(RevisionNotFoundError):
        _api(hub).model_info(REPO, revision=old.name)


def test_hf_hub_download_and_ranges(hub: LocalHub, tmp_path: Path) -> None:
    assert _download(hub, tmp_path / "cache").read_bytes() == MAIN_WEIGHTS
    status, body = _raw(hub, f"/{REPO}/resolve/main/{WEIGHTS}", headers={"Range": "bytes=100-199"})
    assert (status, body) == (206, MAIN_WEIGHTS[100:200])
    assert _raw(hub, f"/{REPO}/resolve/main/{WEIGHTS}", headers={"Range": "bytes=-10"}) == (206, MAIN_WEIGHTS[-10:])
    assert _raw(hub, f"/{REPO}/resolve/main/{WEIGHTS}", headers={"Range": "bytes=70000-"})[0] == 416


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda hub, cache: _api(hub).model_info("org/missing"), RepositoryNotFoundError),
        (lambda hub, cache: _api(hub).model_info(REPO, revision="nope"), RevisionNotFoundError),
        (lambda hub, cache: _api(hub).list_repo_files(REPO, revision="f" * 40), RevisionNotFoundError),
        (
            lambda hub, cache: snapshot_download("org/missing", cache_dir=cache, endpoint=hub.endpoint),
            RepositoryNotFoundError,
        ),
        (lambda hub, cache: _snapshot(hub, cache, revision="nope"), RevisionNotFoundError),
        (lambda hub, cache: _download(hub, cache, "missing.bin"), RemoteEntryNotFoundError),
        (lambda hub, cache: _download(hub, cache, revision="nope"), RevisionNotFoundError),
    ],
    ids=["repo", "revision", "sha", "snapshot-repo", "snapshot-revision", "file", "file-revision"],
)
def test_unknown_repo_revision_file(hub: LocalHub, tmp_path: Path, call, error: type[Exception]) -> None:
    with pytest.raises(error):
        call(hub, tmp_path / "cache")
    assert not any("blobs" in f or "snapshots" in f for f in _cached_files(tmp_path / "cache"))


def test_offline_from_warm_cache(hub: LocalHub, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    warm = _snapshot(hub, cache, allow_patterns=ADAPTER_FILES)
    _snapshot(hub, cache, revision="v1", allow_patterns=ADAPTER_FILES)
    before = len(hub.requests)
    script = f"""
import json
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError
out = {{"main": snapshot_download({REPO!r}, allow_patterns={ADAPTER_FILES!r}),
       "v1": snapshot_download({REPO!r}, revision="v1", allow_patterns={ADAPTER_FILES!r}),
       "file": hf_hub_download({REPO!r}, {CONFIG!r})}}
try:
    snapshot_download({REPO!r}, allow_patterns=["README.md"])
except IncompleteSnapshotError as exc:
    out["incomplete"] = type(exc).__name__
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": hub.endpoint}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["main"]) == warm and Path(out["file"]) == warm / CONFIG
    assert json.loads((Path(out["v1"]) / CONFIG).read_text())["r"] == 4
    assert out["incomplete"] == "IncompleteSnapshotError"
    assert len(hub.requests) == before


@pytest.mark.parametrize(
    ("fault", "error", "status"),
    [
        (HubFault("/api/*", status=401, error_code="RepoNotFound"), RepositoryNotFoundError, 401),
        (HubFault("/api/*", status=401), HfHubHTTPError, 401),
        (HubFault("/api/*", status=404, error_code="RevisionNotFound"), RevisionNotFoundError, 404),
        (HubFault("/api/*", status=500), HfHubHTTPError, 500),
        (HubFault("/api/*", status=503), HfHubHTTPError, 503),
    ],
    ids=["401-repo", "401-plain", "404-revision", "500", "503"],
)
def test_status_faults_on_model_info(hub: LocalHub, fault: HubFault, error: type[Exception], status: int) -> None:
    hub.add_fault(fault)
    with pytest.raises(error) as raised:
        _api(hub).model_info(REPO)
    assert isinstance(raised.value, HfHubHTTPError) and raised.value.response.status_code == status
    assert [r.status for r in hub.requests] == [status]  # model_info never retries


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (HubFault("/api/*", status=401), HfHubHTTPError),  # auth errors are raised as they are
        (HubFault("/api/*", status=500), LocalEntryNotFoundError),  # server errors: "cannot reach, not cached"
        (HubFault("*/resolve/*", method="GET", status=500), HfHubHTTPError),  # GET of a body: no retry either
        (HubFault("*/resolve/*", status=404), LocalEntryNotFoundError),  # 404 without X-Error-Code
        (HubFault("*/resolve/*", status=404, error_code="EntryNotFound"), RemoteEntryNotFoundError),
    ],
    ids=["api-401", "api-500", "get-500", "resolve-404-plain", "resolve-404-entry"],
)
def test_status_faults_on_snapshot(hub: LocalHub, tmp_path: Path, fault: HubFault, error: type[Exception]) -> None:
    hub.add_fault(fault)
    with pytest.raises(error):
        _snapshot(hub, tmp_path / "cache", allow_patterns=ADAPTER_FILES)
    assert not any("blobs/" in f or "snapshots/" in f for f in _cached_files(tmp_path / "cache"))


def test_503_on_head_is_retried(hub: LocalHub, tmp_path: Path, sleeps: list[float]) -> None:
    hub.add_fault(HubFault("*/resolve/*", method="HEAD", status=503, times=1))
    assert _download(hub, tmp_path / "a").read_bytes() == MAIN_WEIGHTS
    assert [(r.method, r.status) for r in hub.requests] == [("HEAD", 503), ("HEAD", 200), ("GET", 200)]
    hub.clear_requests()
    hub.add_fault(HubFault("*/resolve/*", method="HEAD", status=503))
    with pytest.raises(LocalEntryNotFoundError):
        _download(hub, tmp_path / "b")
    assert [r.status for r in hub.requests] == [503] * 7  # one plain HEAD, then 1 + 5 retries with back-off
    assert sleeps == [1, 2, 4, 8, 8]


def test_delay_past_the_etag_timeout_is_retried(hub: LocalHub, tmp_path: Path) -> None:
    hub.add_fault(HubFault("*/resolve/*", method="HEAD", delay_s=1.0, times=1))
    started = time.perf_counter()
    assert _download(hub, tmp_path / "cache", CONFIG, etag_timeout=0.2).read_text().startswith("{")
    assert time.perf_counter() - started < 1.0 and hub.faults == []


def test_delay_is_waited_out(hub: LocalHub, tmp_path: Path) -> None:
    hub.add_fault(HubFault(f"*/{CONFIG}", method="GET", delay_s=0.3))
    started = time.perf_counter()
    assert _download(hub, tmp_path / "cache", CONFIG).exists()
    assert time.perf_counter() - started >= 0.3


def test_truncated_body_leaves_nothing_complete(hub: LocalHub, tmp_path: Path, sleeps: list[float]) -> None:
    cache = tmp_path / "cache"
    hub.add_fault(HubFault(f"*/{WEIGHTS}", truncate_at=1000))
    with pytest.raises(httpx2.RemoteProtocolError):
        _download(hub, cache)
    gets = [r for r in hub.requests if r.method == "GET"]
    assert len(gets) == 6 and sleeps == [1] * 5  # restarted from byte 0 five times: < 10 MiB never resumes
    assert not any("blobs/" in f or "snapshots/" in f or f.endswith(".incomplete") for f in _cached_files(cache))
    hub.clear_faults()
    hub.add_fault(HubFault(f"*/{WEIGHTS}", truncate_at=1000, times=1))
    assert _snapshot(hub, cache, allow_patterns=ADAPTER_FILES).joinpath(WEIGHTS).read_bytes() == MAIN_WEIGHTS


def test_truncated_large_body_resumes_with_range(
    hub: LocalHub, root: Path, tmp_path: Path, sleeps: list[float]
) -> None:
    big = os.urandom(11 << 20)  # past huggingface_hub's 10 MiB read chunk, so the first chunk reaches the file
    _write(root / "org" / "adapter" / "big.safetensors", big)
    hub.add_fault(HubFault("*/big.safetensors", truncate_at=len(big) - 1000, times=1))
    assert _download(hub, tmp_path / "cache", "big.safetensors").read_bytes() == big
    assert [(r.method, r.status) for r in hub.requests] == [("HEAD", 200), ("GET", 200), ("GET", 206)]


@pytest.mark.parametrize(
    "path",
    [
        f"/{REPO}/resolve/main/../../../secret.txt",
        f"/{REPO}/resolve/main/%2e%2e/%2e%2e/%2e%2e/secret.txt",
        f"/{REPO}/resolve/main/..%2f..%2f..%2fsecret.txt",
        f"/{REPO}/resolve/main/..%5c..%5c..%5csecret.txt",
        f"/{REPO}/resolve/main/sub/..\\..\\..\\..\\secret.txt",
        f"/{REPO}/resolve/main//etc/passwd",
        f"/{REPO}/resolve/main/%00secret.txt",
        f"/{REPO}/resolve/..%2f..%2f..%2f/secret.txt",
        f"/{REPO}/resolve/main/leak.txt",
        f"/{REPO}/resolve/main/.revisions/v1/{CONFIG}",
        "/org/linked/resolve/main/secret.txt",
        "/org/%2e%2e/resolve/main/secret.txt",
        "/%2e%2e/hub/resolve/main/secret.txt",
        "/api/models/org/linked",
        f"/api/models/{REPO}/tree/main/..%2f..",
        "/api/models/%2e%2e/%2e%2e",
    ],
)
def test_path_traversal_is_refused(hub: LocalHub, path: str) -> None:
    status, body = _raw(hub, path)
    assert status in (400, 401, 404) and b"TOP-SECRET" not in body


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "8.8.8.8", "localhost", "::1", "example.com", ""])
def test_non_loopback_host_is_refused(root: Path, host: str) -> None:
    with pytest.raises(ValueError, match="loopback"):
        LocalHub(root, host=host)


def test_fault_validation_and_bad_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does nothing"):
        HubFault("*")
    with pytest.raises(ValueError, match="times"):
        HubFault("*", status=500, times=0)
    with pytest.raises(NotADirectoryError):
        LocalHub(tmp_path / "missing")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_cli_entry_stops_cleanly_on_a_signal_even_when_launched_ignoring_sigint(
    root: Path, stop: signal.Signals
) -> None:
    """Started as ``nohup cmd &`` starts it (SIGINT ignored, inherited): either signal still ends it with exit 0."""
    script = (
        "import sys\nfrom adapter_manager.sources.local_hub import serve\n"
        f"serve({str(root)!r}, port=0, on_ready=lambda endpoint: print(endpoint, flush=True))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        endpoint = proc.stdout.readline().decode().strip()
        assert endpoint.startswith("http://127.0.0.1:")
        assert HfApi(endpoint=endpoint, token=False).model_info(REPO).id == REPO
    finally:
        proc.send_signal(stop)
        try:
            code = proc.wait(timeout=10)
        finally:
            proc.kill()
    assert code == 0, proc.stderr.read().decode()


def test_connections_are_kept_alive_as_the_hub_keeps_them(hub: LocalHub, tmp_path: Path) -> None:
    """HTTP/1.1 with keep-alive: one connection answers a registration's requests in turn (huggingface_hub's pooled
    client reuses it), where HTTP/1.0 with Connection: close cost a new connection per request."""
    conn = http.client.HTTPConnection(hub.endpoint.removeprefix("http://"), timeout=5)
    try:
        for method, path in (("GET", f"/api/models/{REPO}"), ("HEAD", f"/{REPO}/resolve/main/{CONFIG}")):
            conn.request(method, path)
            response = conn.getresponse()
            response.read()
            assert (response.status, response.version, response.getheader("Connection")) == (200, 11, None), path
    finally:
        conn.close()
    assert hub.connections == 1
    before, asked = hub.connections, len(hub.requests)
    for name in (CONFIG, WEIGHTS):
        _download(hub, tmp_path / "cache", name)
    assert len(hub.requests) - asked >= 4  # a HEAD and a GET per file
    assert hub.connections - before == 1
