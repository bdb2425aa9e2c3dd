"""The packages keep their layers (docs/architecture.md): every module's imports, read from its source (imports
inside functions included), run only downwards, and no modules import each other in a circle."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> the other packages it may import. Bottom to top: kvcore < router < strategies < kvgate; the agent
# stands on kvcore alone; bench may use everything, and nothing imports bench (kvgate's command table names its
# modules as strings, imported only when chosen; tests are not checked).
MAY_IMPORT: dict[str, frozenset[str]] = {
    "kvcore": frozenset(),
    "router": frozenset({"kvcore"}),
    "strategies": frozenset({"kvcore", "router"}),
    "kvgate": frozenset({"kvcore", "router", "strategies"}),
    "agent": frozenset({"kvcore"}),
    "bench": frozenset({"kvcore", "router", "strategies", "kvgate", "agent"}),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in MAY_IMPORT for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The project modules `name` imports anywhere in its source: `from a import b` names module a.b when there
    is one, else a."""
    known = set(modules)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a module inside a known package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_violations(graph: Mapping[str, set[str]], may_import: Mapping[str, frozenset[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        own = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != own and other not in may_import[own]:
                out.append(f"{module} imports {target}: {own} may import only {sorted(may_import[own]) or 'itself'}")
    return out


def import_circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_import_runs_down_the_layers() -> None:
    graph = import_graph()
    assert {"kvcore.kv_events", "router.app", "strategies.kv", "kvgate.serve", "agent.server"} <= set(graph)
    assert "router.routing" in graph["strategies.prefix"]  # the parser sees real imports
    assert layer_violations(graph, MAY_IMPORT) == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert import_circles(import_graph()) == []


def test_the_checks_catch_what_they_are_for() -> None:
    graph = {"router.a": {"strategies.b"}, "strategies.b": {"router.c"}, "router.c": {"router.a"},
             "agent.x": {"router.config"}, "kvcore.y": set()}
    assert layer_violations(graph, MAY_IMPORT) == [
        "agent.x imports router.config: agent may import only ['kvcore']",
        "router.a imports strategies.b: router may import only ['kvcore']",
    ]
    assert import_circles(graph) == [["router.a", "router.c", "strategies.b"]]
    # imports inside functions count, and `from package import module` names the module
    source = ROOT / "kvgate" / "cli.py"
    assert imports_of("kvgate.cli", source, project_modules()) == set()  # its command table is strings
    assert "bench.workload_options" in imports_of("bench.vsim", ROOT / "bench" / "vsim.py", project_modules())


def test_every_package_is_built_type_checked_and_copied_into_the_image() -> None:
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    built = {name.rstrip("*") for name in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    checked = set(project["tool"]["mypy"]["packages"])
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "docker" / "Dockerfile").read_text(), re.M))
    assert built == copied == set(MAY_IMPORT)
    assert checked == built | {"tests"}  # the tests are type-checked too, never built or shipped
    assert project["project"]["scripts"]["kvgate"] == "kvgate.cli:main"
