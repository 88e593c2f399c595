"""The house rules, checked on the source tree: no import cycles, the planner (and the neutral `modelspec` it shares
with the runtime) never imports JAX or the runtime, and every module stays under 400 lines."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "planner", "modelspec")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that `path` imports anywhere (module level or inside functions), by dotted name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:  # `import a.b.c` resolves to the deepest module that exists
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # A package's __init__ is not an edge source for its submodules (importing a.b runs a/__init__ first).
    return {m: {d for d in _imports(p, modules) if d != m and not m.startswith(d + ".")} for m, p in modules.items()}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert cycles == []


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    (tmp_path / "jaxserve").mkdir()
    (tmp_path / "planner").mkdir()
    (tmp_path / "jaxserve" / "a.py").write_text("from jaxserve.b import x\n")
    (tmp_path / "jaxserve" / "b.py").write_text("def f():\n    from jaxserve import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert "jaxserve.a" in _graph()["jaxserve.b"] and "jaxserve.b" in _graph()["jaxserve.a"]


def test_planner_imports_neither_jax_nor_the_runtime():
    for path in [*(ROOT / "planner").rglob("*.py"), *(ROOT / "modelspec").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert name.split(".")[0] not in ("jax", "jaxlib", "flax", "jaxserve"), f"{path}: {name}"


def test_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
