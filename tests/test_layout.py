"""The house rules, checked on the source tree: no import cycles, the planner (and the neutral `modelspec` it shares
with the runtime) never imports JAX or the runtime, and every module stays under 400 lines."""

import ast
import re
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


# Packages from the bottom up: a module may import its own package and anything on a lower rank, never above.
LAYERS = [
    ("modelspec",),
    ("planner",),
    ("jaxserve.config", "jaxserve.core", "jaxserve.kernels"),
    ("jaxserve.model",),
    ("jaxserve.platform", "jaxserve.scheduler", "jaxserve.structured"),
    ("jaxserve.runner",),
    ("jaxserve.spec_decode",),
    ("jaxserve.engine",),
    ("jaxserve.server", "jaxserve.measure"),
    ("jaxserve.disagg",),
    ("jaxserve.router",),
    ("jaxserve.cli",),
    ("jaxserve",),
]


def _package(module: str) -> str:
    """The LAYERS entry a module belongs to (its longest prefix there)."""
    names = [name for layer in LAYERS for name in layer if module == name or module.startswith(name + ".")]
    return max(names, key=len)


def _rank(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_every_import_runs_down_the_layers():
    up = sorted(f"{m} -> {d}" for m, deps in _graph().items() for d in deps
                if _package(m) != _package(d) and _rank(_package(d)) >= _rank(_package(m)))
    assert up == []


def _private_reads(path: Path) -> list[str]:
    """`x._name` where x is neither self, cls, super() nor an imported module: another object's private member."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        v = node.value
        own = isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in modules)
        own = own or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super")
        if not own and node.attr not in ("_replace", "_asdict", "_fields"):  # namedtuple's public API
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_object_reads_another_objects_private_members():
    # jax has no public counter of a jit's compiled variants: runner/compiles.py is the one reader of `_cache_size`
    exempt = {ROOT / "jaxserve" / "runner" / "compiles.py"}
    assert [r for p in sorted((ROOT / "jaxserve").rglob("*.py")) if p not in exempt for r in _private_reads(p)] == []


def test_the_private_read_check_finds_one(tmp_path):
    source = "import os\n\nclass A:\n    def f(self, b):\n        return self._x, os._exit, b._y\n"
    (tmp_path / "m.py").write_text(source)
    assert [r.split(": ")[1] for r in _private_reads_at(tmp_path / "m.py", tmp_path)] == ["b._y"]


def _private_reads_at(path: Path, root: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, root
    try:
        return _private_reads(path)
    finally:
        ROOT = saved


# A comparison with a platform name, or a device's platform read through an attribute or a helper
# (`is_cpu(device)`, `platform_of(devices)`, `device.platform`): outside jaxserve/platform/ files read
# `PlatformPolicy` or `DeviceFacts` instead.
PLATFORM_TESTS = re.compile(r"default_backend\(|\bplatform\s*(==|!=|in\b)|(==|!=)\s*[\"'](cpu|gpu|cuda|rocm|tpu)[\"']"
                            r"|\bis_cpu\(|\bplatform_of\(|\b(dev|device|devices\[\d+\])\.platform\b")


def test_only_the_platform_policy_asks_which_platform_it_runs_on():
    """Every device-dependent choice is made once, at start-up, in jaxserve/platform/ (the step never asks)."""
    policy = ROOT / "jaxserve" / "platform"
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "jaxserve").rglob("*.py"))
             if policy not in p.parents for i, line in enumerate(p.read_text().splitlines(), 1)
             if PLATFORM_TESTS.search(line.split("#")[0])]
    assert found == []
