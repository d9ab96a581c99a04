"""No jspec module imports another that imports it back, directly or through others, at the
top of the file or inside a function: the layers contract (import-linter) checks packages,
this test the modules inside them. Read from the sources with `ast`, nothing is imported."""

import ast
import os

from support import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "jspec")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO_ROOT)[: -len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def jspec_modules() -> dict[str, str]:
    """Module name -> source path, for every module of the jspec package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                out[module_name(path)] = path
    return out


def imported_modules(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The jspec modules `module` imports anywhere in its source. `from a.b import c` names the
    module a.b.c when there is one, else a.b (c is a name inside it)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                targets.add(full if full in modules else base)
    return {t for t in targets if t in modules and t != module}


def import_graph() -> dict[str, set[str]]:
    modules = jspec_modules()
    return {m: imported_modules(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): every
    circle of imports lies inside one of them."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions_and_relative_ones():
    graph = import_graph()
    assert "jspec.models.common" in graph["jspec.models.deepseek"]
    assert "jspec.models.llama" in graph["jspec.models.forward"]  # `from jspec.models import llama`
    assert "jspec.engine.engine" in graph["jspec"]


def test_the_cycle_finder_finds_two_and_three_module_circles():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []
