"""No import circles in the product code, type-only imports included.

A circle (a imports b imports a) means neither module can be read, tested or moved without the other;
one under `if TYPE_CHECKING:` is the same coupling with the runtime error hidden. Every `import` and
`from … import` anywhere in a module counts: at the top, inside a function, or type-only."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stack", "doctor")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules `name` imports. `from pkg import sub` is an edge to pkg.sub when that is a module,
    else to pkg itself; importing a.b.c is not counted as importing a and a.b (their __init__ is run, but
    a package's __init__ importing its submodules is not a circle anyone reads)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_the_graph_sees_type_only_and_relative_imports() -> None:
    """The checker would pass vacuously if it missed imports: check it finds ones of each kind."""
    graph = _graph()
    assert "stack.common.metrics" in graph["stack.engine.metrics"]  # top level
    assert "stack.router.backends" in graph["stack.router.scheduler"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles_in_stack_and_doctor() -> None:
    """Every circle is listed with its modules, so the message says which edge to cut."""
    graph = _graph()
    circles = _cycles(graph)
    detail = ["  " + ", ".join(c) + "\n    edges: " + "; ".join(f"{a} → {b}" for a in c for b in sorted(graph[a]) if b in c)
              for c in circles]
    assert not circles, "import circles (type-only imports count):\n" + "\n".join(detail)
