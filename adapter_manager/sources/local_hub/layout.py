"""The local hub's data model: repos, revisions, file sets, deterministic commit shas and their Hub API JSON.

See `adapter_manager.sources.local_hub` for the layout itself. Nothing here ever joins a name taken from a request to a
filesystem path: repos are checked segment by segment, revisions and files are looked up in listings built by
walking the hub root, and symlinks are never followed, so a request cannot read outside the root.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..digests import FileDigests

MAIN_REVISION = "main"
REVISIONS_DIR = ".revisions"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")


class HubLookupError(Exception):
    """A repo, revision or file is not in the hub, answered the way the real hub answers it."""

    def __init__(self, code: str, status: int, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.commit = commit


@dataclass(frozen=True)
class HubFile:
    """One regular file of one revision."""

    path: str  # relative path inside the revision, "/"-separated
    location: Path  # where the bytes live on disk
    size: int  # bytes
    sha256: str  # hex sha256 of the content (served as the ETag)
    git_oid: str  # hex git blob sha1 of the content (served as the tree "oid")


@dataclass(frozen=True)
class HubRevision:
    """A resolved revision: its name, deterministic commit sha and file set."""

    repo_id: str  # "org/name"
    name: str  # branch/tag name ("main" for the repo folder itself)
    sha: str  # 40-hex sha1 over the sorted (path, sha256) pairs
    files: dict[str, HubFile]  # relative path -> file


def is_safe_segment(segment: str) -> bool:
    """True if `segment` is a plain name: no separators, no dot-only names, no hidden names, no NUL."""
    return _SEGMENT.fullmatch(segment) is not None and ".." not in segment


def commit_sha(files: dict[str, HubFile]) -> str:
    """The deterministic commit sha of a file set: sha1 over `path NUL sha256 LF` lines in path order."""
    digest = hashlib.sha1()
    for path in sorted(files):
        digest.update(f"{path}\0{files[path].sha256}\n".encode())
    return digest.hexdigest()


class HubLayout:
    """Reads repos and revisions from a hub root, computing file sets and shas on every call."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotADirectoryError(f"hub root {str(root)!r} is not a directory")
        self._digests = FileDigests()

    def repo_dir(self, repo_id: str) -> Path:
        """The folder of `org/name`; HubLookupError(RepoNotFound, 401) if it is not a repo of this hub."""
        parts = repo_id.split("/")
        if len(parts) == 2 and all(is_safe_segment(p) for p in parts):
            path = self.root / parts[0] / parts[1]
            if all(not p.is_symlink() for p in (path.parent, path)) and path.is_dir():
                return path
        raise HubLookupError("RepoNotFound", 401, f"Repository not found: {repo_id!r}")

    def revision_dirs(self, repo_id: str) -> dict[str, Path]:
        """Revision name -> folder: `main` is the repo folder, others are `.revisions/<rev>/`."""
        repo = self.repo_dir(repo_id)
        found = {MAIN_REVISION: repo}
        extra = repo / REVISIONS_DIR
        if extra.is_dir() and not extra.is_symlink():
            for entry in sorted(extra.iterdir()):
                if is_safe_segment(entry.name) and entry.is_dir() and not entry.is_symlink():
                    found.setdefault(entry.name, entry)
        return found

    def resolve(self, repo_id: str, revision: str) -> HubRevision:
        """Resolve a branch/tag name or a 40-hex commit sha; HubLookupError(RevisionNotFound, 404) if unknown."""
        dirs = self.revision_dirs(repo_id)
        if revision in dirs:
            return self._load(repo_id, revision, dirs[revision])
        if _COMMIT_SHA.fullmatch(revision):
            for name, folder in dirs.items():
                loaded = self._load(repo_id, name, folder)
                if loaded.sha == revision:
                    return loaded
        raise HubLookupError("RevisionNotFound", 404, f"Invalid rev id: {revision!r} in {repo_id!r}")

    def _load(self, repo_id: str, name: str, folder: Path) -> HubRevision:
        files: dict[str, HubFile] = {}
        for dirpath, dirnames, filenames in os.walk(folder):
            if Path(dirpath) == folder and REVISIONS_DIR in dirnames:
                dirnames.remove(REVISIONS_DIR)
            dirnames.sort()
            for filename in sorted(filenames):
                location = Path(dirpath) / filename
                st = os.lstat(location)
                if not stat.S_ISREG(st.st_mode):
                    continue
                rel = location.relative_to(folder).as_posix()
                sha256, git_oid = self._digests.digests(location, st)
                files[rel] = HubFile(path=rel, location=location, size=st.st_size, sha256=sha256, git_oid=git_oid)
        return HubRevision(repo_id=repo_id, name=name, sha=commit_sha(files), files=files)


def model_info(revision: HubRevision, blobs: bool) -> dict[str, object]:
    """The `/api/models/{repo_id}[/revision/{rev}]` JSON; `blobs` adds size and git oid per sibling."""
    siblings = [
        {"rfilename": f.path, **({"size": f.size, "blobId": f.git_oid} if blobs else {})}
        for f in sorted(revision.files.values(), key=lambda f: f.path)
    ]
    return {
        "_id": revision.sha[:24],
        "id": revision.repo_id,
        "modelId": revision.repo_id,
        "author": revision.repo_id.split("/")[0],
        "sha": revision.sha,
        "private": False,
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "library_name": "peft",
        "siblings": siblings,
    }


def tree(revision: HubRevision, prefix: str, recursive: bool) -> list[dict[str, object]]:
    """The `/api/models/{repo_id}/tree/{rev}[/{prefix}]` JSON: files and folders below `prefix`."""
    base = f"{prefix}/" if prefix else ""
    below = sorted(p for p in revision.files if p.startswith(base))
    if prefix and not below:
        raise HubLookupError("EntryNotFound", 404, f"{prefix!r} not in {revision.repo_id}", revision.sha)
    folders: set[str] = set()
    entries: list[dict[str, object]] = []
    for path in below:
        *dirs, _ = path[len(base) :].split("/")
        for depth in range(1, (len(dirs) if recursive else min(1, len(dirs))) + 1):
            folders.add(base + "/".join(dirs[:depth]))
        if recursive or not dirs:
            f = revision.files[path]
            entries.append({"type": "file", "oid": f.git_oid, "size": f.size, "path": path})
    for folder in sorted(folders):
        inside = "".join(f"{p}\0{revision.files[p].git_oid}\n" for p in below if p.startswith(folder + "/"))
        entries.append(
            {"type": "directory", "oid": hashlib.sha1(inside.encode()).hexdigest(), "size": 0, "path": folder}
        )
    return entries
