"""No import cycles inside src/dflash2, and no import running back up its layers: the import graph, built from the
AST of every module (imports at module level and inside functions alike, since a lazy import that closes a loop or
reaches up is still one), has no cycle, and no module imports from a layer above its own (:data:`LAYERS`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "dflash2"

# The package's layers, lowest first (docs/architecture.md): a module imports from its own layer and those below,
# never from one above. The platform profile (the CPU, the DFLASH2_* settings), file locks, atomic writes and the
# packages' lazily loaded names know nothing of the engine; the kernels know the platform; caches and verification are pure; the models run on kernels and caches;
# drafters use models; the decode loops use drafters; the public API and the CLI plumbing load decoders; the server,
# benchmarks, the engines benchmarked against (peers: a llama.cpp peer runs a drafter that training exports),
# training and the chat CLI sit on those; the CLI entry point on top. ``dflash2`` is the package's own __init__ only
# (it re-exports the API). A module no entry covers fails the test.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dflash2.platform", "dflash2.locking", "dflash2.atomic", "dflash2.lazy"),
    ("dflash2.kernels",),
    ("dflash2.kv", "dflash2.verify"),
    ("dflash2.models",),
    ("dflash2.drafters",),
    ("dflash2.decode",),
    ("dflash2", "dflash2.api", "dflash2.cli_common"),
    ("dflash2.serve", "dflash2.bench", "dflash2.peers", "dflash2.train", "dflash2.cli_chat"),
    ("dflash2.cli",),
)


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str], package_dir: Path = PACKAGE) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, anywhere in the file. ``from pkg import name`` counts as
    importing ``pkg.name`` when that is a module, else ``pkg``; a package's own ``__init__`` is not an edge of its
    children (importing a child runs it, but it is not what the child reads)."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports} for every .py file under ``package``."""
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in paths}
    return {module_name(p, package): imported_modules(p, modules, package) for p in paths}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
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
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_loop(graph, component) for component in components]


def _one_loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component, for the message."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    loop = [v]
                    while loop[-1] != start:
                        loop.append(previous[loop[-1]])
                    return [start, *reversed(loop[:-1]), start]  # loop: v, previous[v], ..., start
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "dflash2"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text("def f():\n    from dflash2.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    graph = import_graph(pkg)
    assert graph["dflash2.a"] == {"dflash2.sub.b"}
    assert graph["dflash2.sub.b"] == {"dflash2.a"}
    assert find_cycles(graph) == [["dflash2.a", "dflash2.sub.b", "dflash2.a"]]


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the longest entry that is ``module`` or a package holding it (None: no entry); the
    root entry ``dflash2`` stands for the package's __init__ alone."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for index, entries in enumerate(layers):
        for entry in entries:
            holds = "." in entry and module.startswith(entry + ".")
            if (module == entry or holds) and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """``a (layer i) -> b (layer j)`` for every import of a module of a higher layer, and ``a: no layer`` for every
    module no entry covers."""
    found = [f"{m}: no layer (add it to LAYERS)" for m in sorted(graph) if layer_of(m, layers) is None]
    for module in sorted(graph):
        mine = layer_of(module, layers)
        for imported in sorted(graph[module]):
            theirs = layer_of(imported, layers)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{module} (layer {mine}) -> {imported} (layer {theirs})")
    return found


def test_the_layer_check_sees_an_import_running_up(tmp_path):
    pkg = tmp_path / "dflash2"
    (pkg / "low").mkdir(parents=True)
    for f in ("__init__.py", "top.py", "low/__init__.py", "low/a.py", "stray.py"):
        (pkg / f).write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from dflash2 import top\n")  # lazy, and still upward
    (pkg / "top.py").write_text("from dflash2.low import a\n")  # downward: fine
    layers = (("dflash2.low",), ("dflash2", "dflash2.top"))
    assert layer_of("dflash2.low.a", layers) == 0 and layer_of("dflash2.top", layers) == 1
    assert upward_imports(import_graph(pkg), layers) == ["dflash2.stray: no layer (add it to LAYERS)",
                                                         "dflash2.low.a (layer 0) -> dflash2.top (layer 1)"]


def test_no_import_runs_up_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a higher layer in src/dflash2:\n" + "\n".join(upward)


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in src/dflash2:\n" + "\n".join(" -> ".join(c) for c in cycles)
