"""The package's import graph: one import root, no cycles (deferred and TYPE_CHECKING imports included), imports
flowing one way, no file past one concept.

Everything is under ``adapter_manager``. Flow: ``runtime → lifecycle``, ``runtime → kernels``; the lifecycle and
kernels are siblings (neither imports the other). Inside runtime, ``cli/demo/client → cluster → server → engine →
model``; inside the lifecycle, ``facade (manager, prometheus) → registry | policy → tiers → sources → vocabulary
(errors, base_model, metrics)``. runtime reaches kernels through its faces only: ``adapter_manager.kernels`` and a
backend room's ``__init__`` (``kernels.cpu``, ``kernels.triton``, ``kernels.pallas``), never an inner module. The
graph is read from the source with :mod:`ast`, so an import inside a function counts like any other.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("adapter_manager",)
KERNELS = "adapter_manager.kernels"
RUNTIME = "adapter_manager.runtime"

# Lower rank may not import higher rank. Modules not listed here take their package's rank.
_RANK = {
    KERNELS: 0,
    "adapter_manager.errors": 1,  # the lifecycle's vocabulary, shared by every room
    "adapter_manager.base_model": 1,
    "adapter_manager.metrics": 1,
    "adapter_manager.sharding": 1,  # the tensor-parallel plan: which features a shard holds
    "adapter_manager.spmd": 1,  # the SPMD mesh and its sharding marks (XLA)
    "adapter_manager.lazy_names": 1,  # the package roots' names loaded on first use (stdlib only)
    "adapter_manager.sources": 2,  # where adapters come from
    "adapter_manager.tiers": 3,  # where they live: disk, host, the row pool
    "adapter_manager.registry": 4,  # what is registered (moves records through the tiers)
    "adapter_manager.policy": 4,  # what moves them early, what may be evicted
    "adapter_manager": 5,  # the facade: manager, prometheus, and adapter_manager/__init__
    f"{RUNTIME}.model": 6,
    f"{RUNTIME}.engine": 7,
    f"{RUNTIME}.server": 8,
    f"{RUNTIME}.cluster": 9,
    RUNTIME: 10,  # the door: cli, demo, client, options, and runtime/__init__
}
MAX_LINES = 400  # a file past this holds more than one concept (the style card's bound)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _resolve(name: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return name
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, name, is_package)
                targets = [base]
                # `from pkg import submodule` imports the submodule too
                targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            for target in targets:
                # `import a.b.c` names module a.b.c; keep the longest prefix that is one of ours
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _rank(module: str) -> int:
    while module not in _RANK:
        module = module.rpartition(".")[0]
    return _RANK[module]


def test_graph_sees_every_package() -> None:
    graph = _graph()
    expected = {f"{KERNELS}.meta", "adapter_manager.manager", f"{RUNTIME}.engine.engine", f"{RUNTIME}.server.app"}
    assert expected <= set(graph)
    assert {"adapter_manager.sources.hub", "adapter_manager.tiers.allocator", "adapter_manager.policy.prefetch"} <= set(
        graph
    )
    assert "adapter_manager.tiers.prepare" in graph["adapter_manager.registry.registry"]
    assert f"{KERNELS}.meta" in graph[f"{RUNTIME}.model.projection"] | graph[f"{KERNELS}.ops"]


def test_one_import_root() -> None:
    """The source tree has one top-level package: no second import name (``kernels``, ``runtime``) to collide with
    another distribution's."""
    tops = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"tests", "scripts"}
    assert tops == {"adapter_manager"}


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_imports_flow_one_way() -> None:
    wrong = [
        f"{src} -> {dst}"
        for src, targets in sorted(_graph().items())
        for dst in sorted(targets)
        if _rank(dst) > _rank(src)
    ]
    flow = "runtime -> lifecycle -> kernels (server -> engine -> model)"
    assert not wrong, f"imports against {flow}:\n" + "\n".join(wrong)


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_lifecycle_and_kernels_are_siblings() -> None:
    """The lifecycle (everything outside kernels and runtime) never imports kernels, nor kernels the lifecycle."""
    wrong = [
        f"{src} -> {dst}"
        for src, targets in sorted(_graph().items())
        if not _in(src, RUNTIME)
        for dst in sorted(targets)
        if not _in(dst, RUNTIME) and _in(src, KERNELS) != _in(dst, KERNELS)
    ]
    assert not wrong, "the lifecycle and kernels import each other:\n" + "\n".join(wrong)


def _faces(modules: set[str]) -> set[str]:
    """``adapter_manager.kernels`` and each backend room's ``__init__``: the only kernels modules runtime may import."""
    rooms = {m for m in modules if m.startswith(KERNELS + ".") and m.count(".") == 2}
    return {KERNELS} | {m for m in rooms if (ROOT / m.replace(".", "/")).is_dir()}


def test_runtime_reaches_kernels_through_its_faces() -> None:
    graph = _graph()
    faces = _faces(set(graph))
    assert faces == {KERNELS, f"{KERNELS}.cpu", f"{KERNELS}.triton", f"{KERNELS}.pallas"}
    wrong = [
        f"{src} -> {dst}"
        for src, targets in sorted(graph.items())
        if _in(src, RUNTIME)
        for dst in sorted(targets)
        if _in(dst, KERNELS) and dst not in faces
    ]
    assert not wrong, "runtime imports an inner kernels module (use kernels or a room's face):\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", [RUNTIME, f"{RUNTIME}.engine", f"{RUNTIME}.model", "adapter_manager", KERNELS])
def test_light_imports(module: str) -> None:
    """Embedding the engine (a batch job, a Ray replica, a notebook) pulls in no web stack."""
    code = (
        f"import sys, {module}\n"
        "heavy = sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client.exposition') "
        "if m in sys.modules)\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"import {module} pulled in {out.stdout.strip()}"


def test_no_file_past_one_concept() -> None:
    """Every .py file of the package, tests and scripts stays under MAX_LINES lines."""
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for folder in (*PACKAGES, "tests", "scripts")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"files over {MAX_LINES} lines (split them by concept):\n" + "\n".join(long)


_LIFECYCLE_ROOMS = ("sources", "tiers", "registry", "policy", "metrics")
_MANAGER_NAMES = ("manager", "_manager")


def _component_classes(tree: ast.Module) -> set[str]:
    """Names manager.py imports from the lifecycle's rooms (registry, tiers, policy, metrics, sources)."""
    return {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1
        if (node.module or "").split(".")[0] in _LIFECYCLE_ROOMS
        for alias in node.names
    }


def _self_assignments(function: ast.FunctionDef) -> list[tuple[str, ast.expr]]:
    """(attribute, value) of every ``self.<attribute> = value`` in ``function``."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            pairs = [(target, node.value) for target in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                found.append((target.attr, value))
    return found


def _manager_internals() -> set[str]:
    """What `AdapterManager.__init__` keeps that is not its face: every attribute it assigns a component built from
    the lifecycle's rooms, and every private attribute."""
    tree = ast.parse((ROOT / "adapter_manager" / "manager.py").read_text())
    components = _component_classes(tree)
    facade = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AdapterManager")
    init = next(n for n in facade.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    internals = set()
    for attribute, value in _self_assignments(init):
        built = {c.func.id for c in ast.walk(value) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        if attribute.startswith("_") or built & components:
            internals.add(attribute)
    return internals


def _names_a_manager(node: ast.expr) -> bool:
    """`manager`, `_manager`, or `<anything>.manager` / `<anything>._manager`."""
    if isinstance(node, ast.Name):
        return node.id in _MANAGER_NAMES
    return isinstance(node, ast.Attribute) and node.attr in _MANAGER_NAMES


def test_runtime_calls_the_facade_not_its_internals() -> None:
    """runtime reaches the lifecycle through `AdapterManager`'s methods, never through the components it holds (a
    change in the tiers must not break the engine or the server)."""
    internals = _manager_internals()
    assert {"registry", "pool", "allocator", "prefetcher", "swap_metrics"} <= internals
    wrong = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted((ROOT / "adapter_manager" / "runtime").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Attribute) and node.attr in internals and _names_a_manager(node.value)
    ]
    assert not wrong, "runtime reaches into AdapterManager's internals (add a facade method):\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["adapter_manager", RUNTIME])
def test_lazy_package_names_match_their_imports_for_type_checkers(package: str) -> None:
    """A package root that loads its names on first use (PEP 562) lists each once for the loader and once under
    TYPE_CHECKING for type checkers and this file's import graph: the two lists agree, and every name resolves."""
    module = importlib.import_module(package)
    tree = ast.parse(_modules()[package].read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    imported = {node.module: tuple(a.name for a in node.names) for node in guarded.body}
    assert imported == module._EXPORTS
    assert all(getattr(module, name) is not None for name in module.__all__)


# Where the device is decided (kernels/platform.py and the selection it calls, the device rooms, the pool's row
# writers, the SPMD mesh): the only modules that may ask which kind of device a tensor is on, or whether a backend is
# traced. Everything else asks its platform (`kernels.platform_for`) or its executor.
PLATFORM_MODULES = (
    f"{KERNELS}.platform",
    f"{KERNELS}.backend",
    f"{KERNELS}.cpu",
    f"{KERNELS}.triton",
    f"{KERNELS}.pallas",
    f"{KERNELS}.xla_laned",
    "adapter_manager.tiers.row_writers",
    "adapter_manager.spmd",
)
_DEVICE_KINDS = {"cpu", "cuda", "xla", "meta", "mps", "tpu"}
_KIND_ATTRIBUTES = {"traced", "is_cuda", "is_xla", "is_cpu", "is_meta"}


def _device_questions(tree: ast.Module) -> list[tuple[int, str]]:
    """Each place ``tree`` asks a device's kind: ``<x>.type`` of a device, a comparison with a device kind's name,
    ``.traced`` / ``.is_cuda``-style attributes, an import of torch_xla."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _KIND_ATTRIBUTES:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "type":
            base = node.value
            if (isinstance(base, ast.Attribute) and base.attr == "device") or (
                isinstance(base, ast.Call) and ast.unparse(base.func).endswith("device")
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            names = [c for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
            if any(c.value in _DEVICE_KINDS for c in names):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] == "torch_xla" for m in modules):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_device_is_decided_in_the_platform_modules_only() -> None:
    """No module outside :data:`PLATFORM_MODULES` branches on a device's kind or on a backend being traced: the
    platform (and the executor, the row writer) holding each kind's answer is chosen once."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for name, path in sorted(_modules().items())
        if not any(_in(name, room) for room in PLATFORM_MODULES)
        for line, text in _device_questions(ast.parse(path.read_text(), filename=str(path)))
    ]
    assert not wrong, "device kinds asked outside the platform modules (ask kernels.platform_for):\n" + "\n".join(wrong)


def test_the_device_rule_sees_each_kind_of_question() -> None:
    source = (
        "import torch_xla\n"
        "a = x.device.type\nb = torch.device(d).type\nc = kind == 'xla'\nd = meta.backend.traced\ne = t.is_cuda\n"
        "f = x.dtype\ng = torch.device('cpu')\n"
    )
    assert [line for line, _ in _device_questions(ast.parse(source))] == [1, 2, 3, 4, 5, 6]


FACADE_CAP = 52
"""`AdapterManager`'s public members today (43 methods and properties, 9 attributes, 5 of them components): a new one
replaces one, or the facade is split (issue 62)."""


def test_the_facade_stays_small() -> None:
    tree = ast.parse((ROOT / "adapter_manager" / "manager.py").read_text())
    facade = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AdapterManager")
    members = {n.name for n in facade.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    init = next(n for n in facade.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    members |= {attribute for attribute, _ in _self_assignments(init) if not attribute.startswith("_")}
    assert len(members) <= FACADE_CAP, f"AdapterManager has {len(members)} public members (cap {FACADE_CAP})"
