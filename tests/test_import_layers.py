"""The core's modules import in one direction: no circle, and nothing from a floor above.

Every import counts, at module level, inside a function (a late import is
still a dependency) or under ``if TYPE_CHECKING:`` (a circle hidden from the
interpreter is still a circle: each module needs the other to be read). The
floors, bottom up: everything else (data formats, errors, templates, the
hub, ...), then ``sampler``, then what is built on it: ``episode``,
``remote``, ``server``, ``factory``, ``cli`` and ``integrations`` (the
support for tests, ``testing``, may import anything).
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "twinkle_core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the core modules it imports (at run time or for type checking)."""
    modules = {_module_name(p): p for p in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
                targets.update(subs or {base})
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    if top in ("remote", "server", "episode", "factory", "integrations", "cli"):
        return 2
    if top == "sampler":
        return 1
    return 0


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_sampler_and_what_it_stands_on_import_nothing_above() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if module != "twinkle_core" and module.split(".")[1] not in ("testing",)
        for target in targets
        if _floor(target) > _floor(module)
    ]
    assert upward == []


def test_the_check_sees_a_circle_and_an_upward_import() -> None:
    # the checks themselves: a made-up graph with both faults
    graph = {"twinkle_core.sampler": {"twinkle_core.remote"}, "twinkle_core.remote": {"twinkle_core.sampler"}}
    assert circles(graph) == [["twinkle_core.remote", "twinkle_core.sampler"]]
    assert _floor("twinkle_core.remote") > _floor("twinkle_core.sampler")
