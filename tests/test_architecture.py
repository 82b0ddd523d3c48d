"""The house: floors only point down, no cycles, the library never imports the CLI, no path hacks, no private names
across packages, imports at module level (docs/ARCHITECTURE.md). Reads the source with `ast`; imports nothing."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("workbench", "models", "partitioning", "benchmarks")
# (prefix, floor): the longest matching prefix decides; docs/ARCHITECTURE.md draws the same table
FLOORS = (("workbench.errors", 0), ("workbench.testing", 0), ("workbench.compat", 0), ("workbench.cost", 1),
          ("workbench.hardware", 2), ("models", 3), ("partitioning", 3), ("workbench.roofline", 4),
          ("workbench.measure", 5), ("workbench.results", 6), ("workbench.programs", 7), ("benchmarks", 8),
          ("workbench.commands", 9), ("workbench.cli", 9), ("workbench.__main__", 9), ("workbench", 9))


def floor_of(module: str) -> int:
    best = max((p for p, _ in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return dict(FLOORS)[best]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()


def project_imports(name: str, path: Path):
    """(target module, imported names, line, inside a function?) for every import of a project module."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PACKAGES:
                    yield a.name, [], node.lineno, id(node) in inner
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                yield (sub if sub in MODULES else node.module), [a.name], node.lineno, id(node) in inner


EDGES = [(src, tgt, names, line, inner) for src, path in MODULES.items()
         for tgt, names, line, inner in project_imports(src, path) if tgt in MODULES and tgt != src]


def test_floors_only_point_down():
    up = [f"{s}:{line} imports {t} (floor {floor_of(s)} -> {floor_of(t)})" for s, t, _, line, _ in EDGES
          if floor_of(t) > floor_of(s) and not MODULES[t].name == "__init__.py"]
    assert not up, "\n".join(up)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for s, t, *_ in EDGES:
        if MODULES[t].name != "__init__.py":
            graph.setdefault(s, set()).add(t)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in graph.get(v, ()):
            if state.get(w) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(w):] + [w]))
            if w not in state:
                visit(w)
        path.pop()
        state[v] = 2

    for v in list(graph):
        if v not in state:
            visit(v)


def test_library_does_not_import_the_cli():
    bad = [f"{s} -> {t}" for s, t, *_ in EDGES
           if t.startswith("workbench.commands") and not (s.startswith("workbench.commands") or s == "workbench.cli")]
    assert not bad, bad


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_path_hacks_or_private_imports(name):
    src = MODULES[name].read_text()
    assert "sys.path.insert" not in src and "sys.path.append" not in src
    private = [f"{t}.{n}" for s, t, names, _, _ in EDGES if s == name for n in names
               if n.startswith("_") and not n.startswith("__") and t.rpartition(".")[0] != name.rpartition(".")[0]]
    assert not private, private


def test_imports_at_module_level():
    """Only commands defer imports (the program they run, so --help stays fast), and the entry point, which re-executes
    the process before it imports anything heavy; everywhere else they are at the top of the module, where the
    dependency graph can be read."""
    inner = [f"{s}:{line} {t}" for s, t, _, line, is_inner in EDGES
             if is_inner and not (s.startswith("workbench.commands") or s == "workbench.__main__")]
    assert not inner, inner
    total = len(EDGES)
    deferred = sum(1 for *_, is_inner in EDGES if is_inner)
    assert deferred <= 0.06 * total, f"{deferred}/{total} project imports inside functions"
