"""The soak benchmark's adapters on a local hub root: the population, and the revisions its churn publishes.

    hub/soak/s00000 .. s{N-1}   rank 8 on q_proj / v_proj: weights file ``i % K`` of K seeds (hard links into
                                weights/), lora_alpha variant ``i // K``: every adapter's content differs
    hub/soak/w00 .. w63         rank 16 on all seven projections (``write_adapters``, seed = index)
    hub/churn/...               written while the soak runs (new adapters, broken ones); removed at start and end

A published revision k of a repo lives in ``.revisions/v{k}/`` (v0: its original files, copied there before its
first change) and main holds hard links to the current one, so every revision a request saw can be registered again
as ``repo@v{k}`` by the replay. A changed repo is listed in ``dirty.json`` and put back as written by
:meth:`Population.revert` (at the start and end of each run), so a cached population stays the population.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from adapter_manager import BaseModelSpec, write_synthetic_adapter
from adapter_manager.sources.local_hub import HubLayout
from adapter_manager.sources.peft_format import CONFIG_NAME, WEIGHTS_NAME
from scripts.harness.checkpoint import write_adapters

ORG, CHURN_ORG = "soak", "churn"
SMALL_RANK, SMALL_TARGETS = 8, ("q_proj", "v_proj")
WIDE, WIDE_RANK = 64, 16
SEEDS = 128
"""K: distinct weight files of the rank-8 adapters; the alpha variants make N distinct adapters of them."""


def small_id(i: int) -> str:
    return f"{ORG}/s{i:05d}"


def wide_id(j: int) -> str:
    return f"{ORG}/w{j:02d}"


def revision_ref(repo: str, rev: int) -> str:
    return f"{repo}@v{rev}"


@dataclass
class Population:
    """The population under ``root`` (``root/hub`` is the hub root). ``ids``: rank-8 ids, then the rank-16 ones."""

    root: Path
    spec: BaseModelSpec
    size: int  # N rank-8 adapters

    @property
    def hub(self) -> Path:
        return self.root / "hub"

    @property
    def ids(self) -> list[str]:
        return [small_id(i) for i in range(self.size)] + [wide_id(j) for j in range(WIDE)]

    def rank(self, adapter_id: str) -> int:
        return WIDE_RANK if adapter_id.startswith(f"{ORG}/w") else SMALL_RANK

    def write(self) -> float:
        """Write what is missing (a folder is complete once its config is there). Returns seconds."""
        start = time.perf_counter()
        self.revert()
        shutil.rmtree(self.hub / CHURN_ORG, ignore_errors=True)
        seeds = [self.root / "weights" / f"k{k:03d}" for k in range(SEEDS)]
        for k, folder in enumerate(seeds):
            if not (folder / CONFIG_NAME).exists():
                self._write_small(folder, seed=k)
        for i in range(self.size):
            if not (self.hub / small_id(i) / CONFIG_NAME).exists():
                self._link_small(i)
        write_adapters(self.hub, self.spec, [wide_id(j) for j in range(WIDE)], [WIDE_RANK] * WIDE, reuse=True)
        an_hour_ago = time.time() - 3600  # the hub hashes a file younger than 2 s on every request
        for folder in [*seeds, *(self.hub / a for a in self.ids)]:
            for file in folder.iterdir():
                if file.is_file():
                    os.utime(file, (an_hour_ago, an_hour_ago))
        return time.perf_counter() - start

    def _write_small(self, folder: Path, seed: int, alpha: float = 2.0 * SMALL_RANK) -> None:
        write_synthetic_adapter(
            folder, self.spec, r=SMALL_RANK, lora_alpha=alpha, target_modules=SMALL_TARGETS, seed=seed
        )

    def _link_small(self, i: int) -> None:
        """Adapter i: weights file i % K (a hard link), lora_alpha 8 (1 + v / 40) for variant v = i // K."""
        source = self.root / "weights" / f"k{i % SEEDS:03d}"
        folder = self.hub / small_id(i)
        folder.mkdir(parents=True, exist_ok=True)
        _replace_link(source / WEIGHTS_NAME, folder / WEIGHTS_NAME)
        config = json.loads((source / CONFIG_NAME).read_text())
        config["lora_alpha"] = SMALL_RANK * (1.0 + (i // SEEDS) / 40)
        (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))

    def disk_bytes(self) -> int:
        """Bytes of the population's files as the server's HF cache holds them (one copy per adapter)."""
        return sum((self.hub / a / f).stat().st_size for a in self.ids for f in (CONFIG_NAME, WEIGHTS_NAME))

    def sha(self, repo: str, revision: str = "main") -> str:
        """The hub's commit sha of a revision of `repo` (what the server reports as ``sha``)."""
        return HubLayout(self.hub).resolve(repo, revision).sha

    # -- what the churn publishes ------------------------------------------------------------------------------

    def _dirty(self, repo: str) -> None:
        path = self.root / "dirty.json"
        dirty = set(json.loads(path.read_text())) if path.exists() else set()
        if repo not in dirty and repo.startswith(f"{ORG}/"):
            path.write_text(json.dumps(sorted(dirty | {repo})))

    def publish(self, repo: str, rev: int, seed: int) -> str:
        """New weights (``seed``) as revision ``rev`` of `repo`, made main; v0 kept first. Returns its sha."""
        folder = self.hub / repo
        self._dirty(repo)
        revisions = folder / ".revisions"
        if not (revisions / "v0").exists():
            _link_files(folder, revisions / "v0")
        self._write_small(revisions / f"v{rev}", seed=seed)
        _link_files(revisions / f"v{rev}", folder)
        return self.sha(repo)

    def break_main(self, repo: str, kind: str) -> None:
        """Put broken files at main (``kind``: weights = a truncated safetensors, config = rank over the limit)."""
        folder = self.hub / repo
        self._dirty(repo)
        if not (folder / ".revisions" / "v0").exists():
            _link_files(folder, folder / ".revisions" / "v0")
        _write_broken(folder, kind)

    def restore_main(self, repo: str, rev: int) -> None:
        """Main back to revision ``rev`` (after :meth:`break_main`)."""
        _link_files(self.hub / repo / ".revisions" / f"v{rev}", self.hub / repo)

    def new_adapter(self, name: str, seed: int) -> str:
        """A new rank-8 repo ``churn/<name>``; returns its id."""
        repo = f"{CHURN_ORG}/{name}"
        self._write_small(self.hub / repo, seed=seed)
        return repo

    def broken_adapter(self, name: str, kind: str, seed: int) -> str:
        """A new repo ``churn/<name>`` that must be refused: see :func:`_write_broken`."""
        repo = f"{CHURN_ORG}/{name}"
        self._write_small(self.hub / repo, seed=seed)
        _write_broken(self.hub / repo, kind)
        return repo

    def revert(self) -> None:
        """Every repo a churn changed back to its original files; the churn's own repos removed."""
        path = self.root / "dirty.json"
        for repo in json.loads(path.read_text()) if path.exists() else []:
            folder = self.hub / repo
            shutil.rmtree(folder / ".revisions", ignore_errors=True)
            if repo.startswith(f"{ORG}/s"):
                self._link_small(int(repo.rsplit("s", 1)[1]))
            else:
                shutil.rmtree(folder, ignore_errors=True)
                seed = int(repo.rsplit("w", 1)[1])
                write_synthetic_adapter(folder, self.spec, r=WIDE_RANK, lora_alpha=2.0 * WIDE_RANK, seed=seed)
        path.unlink(missing_ok=True)
        shutil.rmtree(self.hub / CHURN_ORG, ignore_errors=True)


def _replace_link(source: Path, target: Path) -> None:
    """`target` becomes a hard link to `source`, replaced atomically (never written through: links share bytes)."""
    if target.exists() and os.path.samefile(source, target):
        return  # rename(2) between two links of one file does nothing: the temporary link would stay
    tmp = target.with_name(target.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.replace(tmp, target)


def _link_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        _replace_link(source / name, target / name)


def _write_broken(folder: Path, kind: str) -> None:
    """kind ``weights``: the safetensors file cut to its first 1000 bytes; ``config``: rank 64 (over the server's
    max rank); ``target``: an unknown target module; ``json``: not JSON at all. Written as new files (not through a
    hard link)."""
    if kind == "weights":
        data = (folder / WEIGHTS_NAME).read_bytes()[:1000]
        (folder / WEIGHTS_NAME).unlink()
        (folder / WEIGHTS_NAME).write_bytes(data)
        return
    config = json.loads((folder / CONFIG_NAME).read_text())
    text = "{not json"
    if kind == "config":
        text = json.dumps({**config, "r": 64, "lora_alpha": 128})
    elif kind == "target":
        text = json.dumps({**config, "target_modules": ["q_proj", "not_a_module"]})
    (folder / CONFIG_NAME).unlink()
    (folder / CONFIG_NAME).write_text(text)
