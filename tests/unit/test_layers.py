"""The source tree keeps the shape docs/architecture.md draws: each package imports only packages
listed below it (annotation-only imports included), no module imports itself back through
others (function-level imports included: a lazy circle is still a circle), and no file or
function, benchmarks included, grows past the sizes a reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# docs/architecture.md's Layers, lowest first
LAYERS = ("cachemap", "policies", "engines", "router", "loadgen", "simulation", "deploy")
# every package, and the benchmarks (code users read to reproduce a figure)
SIZED = (*LAYERS, "benchmarks")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 100


def _modules() -> dict[str, Path]:
    out = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.Module, type_checking: bool) -> set[str]:
    """Absolute module names ``tree`` imports anywhere (``from a import b`` counts ``a`` and
    ``a.b``); ``if TYPE_CHECKING:`` blocks only with ``type_checking``."""
    skip: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_a_package_imports_only_the_layers_below_it() -> None:
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = []
    for name, path in _modules().items():
        own = rank[name.split(".")[0]]
        for imported in _imports(ast.parse(path.read_text()), type_checking=True):
            top = imported.split(".")[0]
            if top in rank and rank[top] > own:
                upward.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not upward, upward


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    graph = {
        name: {m for m in _imports(ast.parse(path.read_text()), False) if m in modules} - {name}
        for name, path in modules.items()
    }
    assert not _circles(graph)


def test_the_circle_finder_finds_a_lazy_circle() -> None:
    a = ast.parse("from b import f\n")
    b = ast.parse("def g():\n    from a import h\n")
    graph = {"a": _imports(a, False) & {"b"}, "b": _imports(b, False) & {"a"}}
    assert _circles(graph) == [["a", "b"]]
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import h\n")
    assert not _imports(hidden, False) & {"a"} and _imports(hidden, True) & {"a"}


def _says_why_whole(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A numba kernel (``@jit``) may run long where its docstring says why it stays whole: a
    call between kernels costs what the hot path cannot pay."""
    jitted = any(ast.unparse(d).split("(")[0].endswith("jit") for d in node.decorator_list)
    return jitted and "stays whole" in (ast.get_docstring(node) or "")


def test_files_and_functions_stay_readable() -> None:
    big = []
    for package in SIZED:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(ROOT)
            if text.count("\n") > MAX_FILE_LINES:
                big.append(f"{where}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES and not _says_why_whole(node):
                        big.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    assert not big, big


# what the router may import of engines/: the protocol, the cost model, the pool link's pricing and
# the event bus's router side (docs/architecture.md); the bus room imports of engines/ only the
# protocol and the engine core's report
ROUTER_REACHES = {"engines.base", "engines.profile", "engines.pool.link"}
BUS_REACHES = {"engines", "engines.base", "engines.core_report"}


def test_the_router_and_the_bus_reach_engines_only_through_their_rooms() -> None:
    modules = _modules()
    graph = {
        name: {m for m in _imports(ast.parse(path.read_text()), True) if m in modules}
        for name, path in modules.items()
    }
    engines = {m for m in modules if m == "engines" or m.startswith("engines.")}
    router = {d for n, deps in graph.items() if n.startswith("router") for d in deps} & engines
    assert {d for d in router if not d.startswith("engines.bus.")} <= ROUTER_REACHES, router
    bus = {d for n, deps in graph.items() if n.startswith("engines.bus") for d in deps} & engines
    assert {d for d in bus if not d.startswith("engines.bus")} <= BUS_REACHES, bus
