"""The layering of DESIGN.md, checked on the source: host -> proto, sim -> hw -> proto,
nothing imports upward, and no module imports itself back through others.

Every module of the packages pyproject.toml maps (api/ -> fpgaccl, proto/ ->
fpgaccl.proto, ...) is parsed with ``ast``; every import counts, at module level or
inside a function (a lazy import is still a dependency), except those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SIM_MAY_IMPORT_HOST = {
    # The HDL transport against the host's software QueuePair, frame by frame.
    "fpgaccl.sim.benches.transport_interop",
    # The HDL parser/builder checked against the host's scapy layers (RETH, ImmDt).
    "fpgaccl.sim.tb.net_frames",
}
PROTO_MAY_IMPORT = {"fpgaccl.errors"}  # the exception types, a leaf below every package


@cache
def modules() -> dict[str, Path]:
    """Module name -> file, for every mapped package folder."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = {}
    for pkg, folder in cfg["package-dir"].items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join([pkg, *parts])] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


@cache
def graph() -> dict[str, dict[str, int]]:
    """Module -> {imported fpgaccl module: line}."""
    mods = modules()
    out: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` names a module; `from mod import name` does not.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for t in targets:
                if t == "fpgaccl" or t.startswith("fpgaccl."):
                    deps.setdefault(t, node.lineno)
        out[name] = deps
    return out


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cycles() -> list[tuple[list[str], list[str]]]:
    """Per group of modules that reach one another: one cycle through it (a path that
    returns to its start) and the whole group."""
    g = {m: [d for d in deps if d in modules()] for m, deps in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:   # Tarjan; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in g[v]:
                groups.append(group)

    for v in sorted(g):
        if v not in index:
            connect(v)
    out = []
    for group in groups:
        # The shortest way from the group's first module back to itself (breadth first).
        start = min(group)
        parent: dict[str, str] = {}
        queue, end = [start], start
        for u in queue:   # the queue grows while it is walked
            if start in g[u]:
                end = u
                break
            for w in g[u]:
                if w in group and w not in parent and w != start:
                    parent[w] = u
                    queue.append(w)
        path = [start]
        while end != start:
            path.insert(1, end)
            end = parent[end]
        out.append(([*path, start], sorted(group)))
    return out


def _report(bad: list[str]) -> str:
    return "\n".join(bad)


def _cycle(path: list[str], group: list[str]) -> str:
    return " -> ".join(path) + (f" (in a group of {len(group)}: {', '.join(group)})"
                                if len(group) > len(path) - 1 else "")


def test_every_module_is_found():
    mods = modules()
    for name in ("fpgaccl", "fpgaccl.errors", "fpgaccl.proto.framing", "fpgaccl.hw.node",
                 "fpgaccl.sim.server", "fpgaccl.sim.servers.loop", "fpgaccl.host.launcher",
                 "fpgaccl.boards.build"):
        assert name in mods, name


def test_every_import_of_the_package_resolves():
    mods = modules()
    bad = [f"{m}:{line} imports {t}, which does not exist" for m, deps in graph().items()
           for t, line in deps.items() if t not in mods]
    assert not bad, _report(bad)


@pytest.mark.parametrize("package", ["fpgaccl.proto", "fpgaccl.hw", "fpgaccl.sim",
                                     "fpgaccl.boards"])
def test_no_import_cycle(package):
    bad = [_cycle(c, group) for c, group in cycles() if any(_in(m, package) for m in group)]
    assert not bad, _report(bad)


def test_no_import_cycle_in_host():
    bad = [_cycle(c, group) for c, group in cycles()
           if not any(_in(m, p) for m in group
                      for p in ("fpgaccl.proto", "fpgaccl.hw", "fpgaccl.sim", "fpgaccl.boards"))]
    assert not bad, _report(bad)


def test_sim_does_not_import_host():
    bad = [f"{m}:{line} imports {t}" for m, deps in graph().items()
           if _in(m, "fpgaccl.sim") and m not in SIM_MAY_IMPORT_HOST
           for t, line in deps.items() if _in(t, "fpgaccl.host")]
    assert not bad, _report(bad)


def test_the_allowed_sim_to_host_imports_are_still_needed():
    for m in SIM_MAY_IMPORT_HOST:
        assert any(_in(t, "fpgaccl.host") for t in graph()[m]), m


def test_proto_imports_only_proto():
    bad = [f"{m}:{line} imports {t}" for m, deps in graph().items()
           if _in(m, "fpgaccl.proto")
           for t, line in deps.items() if not _in(t, "fpgaccl.proto") and t not in PROTO_MAY_IMPORT]
    assert not bad, _report(bad)
    for m in PROTO_MAY_IMPORT:
        assert not graph()[m], f"{m} must stay a leaf: it imports {sorted(graph()[m])}"


def test_hw_imports_neither_sim_nor_host():
    bad = [f"{m}:{line} imports {t}" for m, deps in graph().items() if _in(m, "fpgaccl.hw")
           for t, line in deps.items() if _in(t, "fpgaccl.sim") or _in(t, "fpgaccl.host")]
    assert not bad, _report(bad)
