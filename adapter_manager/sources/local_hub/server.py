"""A local Hugging Face Hub mirror: serves a folder of adapters on loopback for the unmodified huggingface_hub client.

Layout of the hub root::

    ROOT/<org>/<name>/                    files of revision "main" (all regular files, recursively)
    ROOT/<org>/<name>/.revisions/<rev>/   optional other revisions (branches/tags), each a full file set

Each revision's commit sha is a sha1 over its sorted ``(relative path, sha256 of content)`` pairs (see
`layout.commit_sha`), so editing any file changes the sha. A request may name a revision by branch/tag or by
its 40-hex sha. Everything is recomputed on each request, so a test can edit a repo between calls. Symlinks,
``.revisions`` and hidden or dotted repo names are never served.

Endpoints, as huggingface_hub 2.4 uses them (``HF_ENDPOINT`` or ``endpoint=`` set to `LocalHub.endpoint`):

- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}`` — ``X-Repo-Commit``, ``ETag`` (quoted sha256), ``Content-Length``,
  ``Accept-Ranges``; single ``Range: bytes=a-b`` requests answer 206 (the client resumes with them).
- ``GET /api/models/{org}/{name}`` and ``.../revision/{rev}`` — model info: ``id``, ``sha``, ``siblings``, ...
- ``GET /api/models/{org}/{name}/tree/{rev}[/{path}]`` — the tree listing `snapshot_download` and
  `list_repo_files` use (``?recursive=true`` lists everything below).

Errors carry the real hub's ``X-Error-Code``: unknown repo -> 401 ``RepoNotFound``, unknown revision -> 404
``RevisionNotFound``, unknown file -> 404 ``EntryNotFound`` (with ``X-Repo-Commit``), malformed path -> 400.
Tests inject faults (status codes, delays, truncated bodies) with `LocalHub.add_fault` while the server runs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import cast
from urllib.parse import parse_qs, unquote, urlsplit

from adapter_manager.sources.local_hub.faults import HubFault, HubRequest, HubState
from adapter_manager.sources.local_hub.layout import HubLayout, HubLookupError, HubRevision, model_info, tree

logger = logging.getLogger(__name__)

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_CHUNK = 1 << 16


@dataclass
class _Reply:
    """A response ready to send: a bytes body or a byte range of a file."""

    status: int  # HTTP status
    headers: dict[str, str]  # headers besides Content-Length
    body: bytes = b""  # in-memory body, used when `file` is None
    file: Path | None = None  # file to stream the body from
    start: int = 0  # first byte of `file` to send
    length: int = 0  # bytes of `file` to send

    @property
    def content_length(self) -> int:
        return self.length if self.file is not None else len(self.body)


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: HubState) -> None:
        super().__init__(address, _HubHandler)
        self.state = state
        self._open: set[socket.socket] = set()  # connections being served (kept alive between requests)
        self._open_lock = threading.Lock()
        self.accepted = 0  # connections accepted so far

    def process_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        with self._open_lock:
            self._open.add(request)
            self.accepted += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:  # noqa: ANN001 - socketserver's signature
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def accepted_count(self) -> int:
        with self._open_lock:
            return self.accepted

    def close_connections(self) -> None:
        """End every kept-alive connection (their handler threads then return)."""
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: object, client_address: object) -> None:
        logger.debug("local hub: error while answering %s", client_address, exc_info=True)


class _HubHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, as the Hub speaks it: a client reuses its connection for the next request (a
    registration's sha lookup, then each file's HEAD and GET); only a truncated answer closes it."""

    server_version = "adapter-manager-local-hub"
    protocol_version = "HTTP/1.1"
    timeout = 60  # an idle kept-alive connection is closed after this many seconds
    disable_nagle_algorithm = True  # headers and body are separate writes: with Nagle, a kept-alive connection
    # waits out the client's delayed ACK (~40 ms) before every body

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        logger.debug("local hub %s: " + format, self.address_string(), *args)

    def _handle(self, method: str) -> None:
        state = cast(_HubServer, self.server).state
        path = urlsplit(self.path).path
        fault = state.take_fault(method, path)
        if fault is not None and fault.delay_s > 0 and state.stopping.wait(fault.delay_s):
            state.record(HubRequest(method=method, path=path, status=0))
            self.close_connection = True
            return
        if fault is not None and fault.status is not None:
            reply = _error(fault.status, fault.error_code, f"injected fault {fault.status} for {path}")
        else:
            reply = self._route(state.layout)
        state.record(HubRequest(method=method, path=path, status=reply.status))  # before a client can see it
        try:
            self._send(reply, head_only=method == "HEAD", truncate_at=fault.truncate_at if fault else None)
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as exc:
            logger.debug("local hub: client went away during %s %s: %s", method, path, exc)

    def _route(self, layout: HubLayout) -> _Reply:
        split = urlsplit(self.path)
        try:
            parts = [unquote(p, errors="strict") for p in split.path.split("/")[1:]]
        except UnicodeDecodeError:
            return _error(400, None, "path is not valid UTF-8")
        query = parse_qs(split.query)
        try:
            if parts[:2] == ["api", "models"]:
                return _api(parts[2:], query, layout)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts, layout)
        except HubLookupError as exc:
            return _error(exc.status, exc.code, str(exc), exc.commit)
        return _error(404, None, f"no such endpoint: {split.path}")

    def _resolve(self, parts: list[str], layout: HubLayout) -> _Reply:
        repo_id, rev, file_parts = f"{parts[0]}/{parts[1]}", parts[3], parts[4:]
        if not _safe_file_parts(file_parts):
            return _error(400, None, f"invalid file path {'/'.join(file_parts)!r}")
        revision = layout.resolve(repo_id, rev)
        entry = revision.files.get("/".join(file_parts))
        if entry is None:
            raise HubLookupError("EntryNotFound", 404, f"{'/'.join(file_parts)!r} not in {repo_id}@{rev}", revision.sha)
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{entry.sha256}"',
            "X-Repo-Commit": revision.sha,
        }
        start, end = 0, entry.size
        requested = self.headers.get("Range")
        match = _RANGE.fullmatch(requested.strip()) if requested else None
        if match is not None and (match[1] or match[2]):
            if match[1]:
                start, end = int(match[1]), min(entry.size, int(match[2]) + 1 if match[2] else entry.size)
            else:
                start = max(0, entry.size - int(match[2]))
            if start >= end:
                return _error(416, None, f"range {requested} outside {entry.size} bytes", revision.sha)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{entry.size}"
        status = 206 if "Content-Range" in headers else 200
        return _Reply(status=status, headers=headers, file=entry.location, start=start, length=end - start)

    def _send(self, reply: _Reply, head_only: bool, truncate_at: int | None) -> None:
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(reply.content_length))
        if truncate_at is not None and not head_only:  # fewer bytes than announced: only a close tells the client
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        if head_only:
            return
        if reply.file is None:
            self.wfile.write(reply.body if truncate_at is None else reply.body[:truncate_at])
            return
        end = reply.start + reply.length if truncate_at is None else min(reply.start + reply.length, truncate_at)
        with open(reply.file, "rb") as f:
            f.seek(reply.start)
            left = max(0, end - reply.start)
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                self.wfile.write(chunk)
                left -= len(chunk)
        self.wfile.flush()


def _safe_file_parts(parts: list[str]) -> bool:
    """True if every path segment is a plain file or folder name (no traversal, separators, NUL or empties)."""
    return bool(parts) and all(p not in ("", ".", "..") and not any(c in p for c in "/\\\0") for p in parts)


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[0].lower() in ("1", "true")


def _json(payload: object, revision: HubRevision | None = None) -> _Reply:
    headers = {"Content-Type": "application/json"}
    if revision is not None:
        headers["X-Repo-Commit"] = revision.sha
    return _Reply(status=200, headers=headers, body=json.dumps(payload).encode())


def _error(status: int, code: str | None, message: str, commit: str | None = None) -> _Reply:
    message = message.encode("unicode_escape").decode("ascii")  # no CR/LF or non-latin-1 in a header
    headers = {"Content-Type": "application/json", "X-Error-Message": message}
    if code is not None:
        headers["X-Error-Code"] = code
    if commit is not None:
        headers["X-Repo-Commit"] = commit
    return _Reply(status=status, headers=headers, body=json.dumps({"error": message}).encode())


def _api(parts: list[str], query: dict[str, list[str]], layout: HubLayout) -> _Reply:
    """`/api/models/...` with `parts` = [org, name, ...]."""
    repo_id, rest = "/".join(parts[:2]), parts[2:]
    if not rest or (rest[0] == "revision" and len(rest) == 2):
        revision = layout.resolve(repo_id, rest[1] if rest else "main")
        return _json(model_info(revision, _flag(query, "blobs")), revision)
    if rest[0] == "tree" and len(rest) >= 2:
        if rest[2:] and not _safe_file_parts(rest[2:]):
            return _error(400, None, f"invalid tree path {'/'.join(rest[2:])!r}")
        revision = layout.resolve(repo_id, rest[1])
        return _json(tree(revision, "/".join(rest[2:]), _flag(query, "recursive")), revision)
    layout.repo_dir(repo_id)
    return _error(404, None, f"no such endpoint: /api/models/{'/'.join(parts)}")


class LocalHub:
    """A Hub mirror of `root` on 127.0.0.1; a context manager that serves from a daemon thread.

    Usage::

        with LocalHub(tmp_path / "hub") as hub:
            snapshot_download("org/name", endpoint=hub.endpoint, cache_dir=...)
            hub.add_fault(HubFault("*/resolve/*", status=503, times=1))
            assert not [r for r in hub.requests if "/resolve/" in r.path and r.method == "GET"]
    """

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0) -> None:
        _check_loopback(host)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self._state = HubState(layout=HubLayout(root))
        self._server = _HubServer((host, port), self._state)
        self._thread: threading.Thread | None = None

    @property
    def root(self) -> Path:
        """The served folder (resolved)."""
        return self._state.layout.root

    @property
    def endpoint(self) -> str:
        """The base URL, e.g. "http://127.0.0.1:40123": pass as HF_ENDPOINT or `endpoint=`."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> list[HubRequest]:
        """A copy of the request log, in answer order."""
        with self._state.lock:
            return list(self._state.requests)

    @property
    def connections(self) -> int:
        """TCP connections accepted so far (a client keeping its connection alive opens one for many requests)."""
        return self._server.accepted_count()

    @property
    def faults(self) -> list[HubFault]:
        """The faults that still apply (not used up)."""
        with self._state.lock:
            return [fault for fault, remaining in self._state.faults if remaining[0] != 0]

    def add_fault(self, fault: HubFault) -> HubFault:
        """Inject `fault`; faults are tried in the order added and the first matching one applies."""
        with self._state.lock:
            self._state.faults.append((fault, [fault.times]))
        return fault

    def clear_faults(self) -> None:
        with self._state.lock:
            self._state.faults.clear()

    def clear_requests(self) -> None:
        with self._state.lock:
            self._state.requests.clear()

    def start(self) -> LocalHub:
        """Serve from a daemon thread; returns self."""
        if self._thread is not None:
            raise RuntimeError(f"local hub at {self.endpoint} is already started")
        if self._state.stopping.is_set():
            raise RuntimeError(f"local hub at {self.endpoint} was stopped; make a new LocalHub")
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="local-hub", daemon=True)
        self._thread.start()
        logger.info("local hub serving %s at %s", self.root, self.endpoint)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; in-flight delayed requests end without an answer."""
        self._state.stopping.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._server.close_connections()

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _check_loopback(host: str) -> None:
    try:
        loopback = ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"the local hub only binds an IPv4 loopback address such as 127.0.0.1, got host={host!r}")


def serve(
    root: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve `root` as a Hub mirror in the calling thread until SIGINT or SIGTERM, then close the socket (the `hub
    serve DIR` command); `on_ready` gets the endpoint. From the main thread both signals stop it, also when it was
    launched ignoring SIGINT (as ``nohup cmd &`` launches it); their handlers are restored on return."""
    hub = LocalHub(root, host=host, port=port)
    stops = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in stops}  # raise KeyboardInterrupt
    logger.info("local hub serving %s at %s", hub.root, hub.endpoint)
    try:
        if on_ready is not None:
            on_ready(hub.endpoint)
        hub._server.serve_forever()
    except KeyboardInterrupt:
        logger.info("local hub at %s interrupted; stopped", hub.endpoint)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        hub.stop()


__all__ = ["HubFault", "HubRequest", "LocalHub", "serve"]
