"""The packages' import graph: no cycles (deferred and TYPE_CHECKING imports included), and imports flow one way.

Flow: ``runtime → adapter_manager → kernels``; inside runtime, ``cli/demo/client → server → engine → model``.
The graph is read from the source with :mod:`ast`, so an import inside a function counts like any other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "adapter_manager", "runtime")

# Lower rank may not import higher rank. Modules not listed here take their package's rank.
_RANK = {
    "kernels": 0,
    "adapter_manager": 1,
    "runtime.model": 2,
    "runtime.engine": 3,
    "runtime.server": 4,
    "runtime": 5,  # the door: cli, demo, client, and runtime/__init__
}


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
    assert {"kernels.meta", "adapter_manager.manager", "runtime.engine.engine", "runtime.server.app"} <= set(graph)
    assert "kernels.meta" in graph["runtime.model.lora_linear"] | graph["kernels.ops"]


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
    flow = "runtime -> adapter_manager -> kernels (server -> engine -> model)"
    assert not wrong, f"imports against {flow}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", ["runtime", "runtime.engine", "runtime.model", "adapter_manager", "kernels"])
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
