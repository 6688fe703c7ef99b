"""The package's import arrows point down: each rule names a package and what it may not import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "mstar"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``: imports for annotations only, never run."""
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(tree: ast.AST, runtime_only: bool):
    """Every import statement of a module (inside functions too); ``runtime_only``: not those under
    ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if runtime_only and _type_checking_only(node):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _parsed() -> dict[str, ast.AST]:
    return {_module_name(path): ast.parse(path.read_text(), str(path)) for path in ROOT.rglob("*.py")}


def _all_imports(runtime_only: bool = False) -> dict[str, set[str]]:
    """Every mstar module -> every module it imports, mstar's and others' (lazy imports inside
    functions included; ``from package import submodule`` counts as importing the submodule)."""
    trees = _parsed()
    out: dict[str, set[str]] = {}
    for module, tree in trees.items():
        names: set[str] = set()
        for node in _import_nodes(tree, runtime_only):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & trees.keys()
                names.update(subs)
                if len(subs) < len(node.names):
                    names.add(node.module)
        out[module] = names
    return out


def _imports(runtime_only: bool = False) -> dict[str, set[str]]:
    """Every mstar module -> the mstar modules it imports (see ``_all_imports``)."""
    return {m: {n for n in names if n == "mstar" or n.startswith("mstar.")}
            for m, names in _all_imports(runtime_only).items()}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# (importer package, packages it may import from mstar; None = no limit beyond the forbidden list,
#  packages it must not import)
ALLOWED_RUNTIME_BOTTOM = ("mstar.runtime.failures", "mstar.runtime.keys", "mstar.runtime.work_items")
# a model family: a package under mstar.models (mstar.models itself is the registry's torch-free table)
FAMILIES = tuple(sorted(f"mstar.models.{p.name}" for p in (ROOT / "models").iterdir()
                        if p.is_dir() and (p / "__init__.py").is_file()))
FAMILY_MODULES = tuple(sorted(f"mstar.models.{p.stem}" for p in (ROOT / "models").glob("*.py") if p.stem != "__init__"))
RULES: list[tuple[str, tuple[str, ...] | None, tuple[str, ...]]] = [
    ("mstar.graph", ("mstar.graph",), ()),
    # the model layer reaches up into mstar.models only for the table (mstar/model/registry.py)
    ("mstar.model", None, ("mstar.runtime", "mstar.server", "mstar.cli", *FAMILIES, *FAMILY_MODULES)),
    ("mstar.layers", None, ("mstar.runtime", "mstar.server", "mstar.cli", "mstar.models")),
    ("mstar.models", None, ("mstar.runtime", "mstar.server", "mstar.cli")),
    # the runtime finds families only through the registry
    ("mstar.runtime", None, ("mstar.server", "mstar.cli", *FAMILIES, *FAMILY_MODULES)),
    ("mstar.runtime.wire", ("mstar.runtime.wire", *ALLOWED_RUNTIME_BOTTOM, "mstar.graph", "mstar.model",
                            "mstar.placement"), ()),
    ("mstar.runtime.kv", ("mstar.runtime.kv", "mstar.runtime.engine", *ALLOWED_RUNTIME_BOTTOM, "mstar.layers",
                          "mstar.model", "mstar.graph"), ()),
    # the server speaks to a family through its adapter, looked up by the model layer
    ("mstar.server", None, ("mstar.cli", *FAMILIES, *FAMILY_MODULES)),
    # the client speaks HTTP only
    ("mstar.client", ("mstar.client",), ()),
    # the planner drives the runtime (and finds families through the registry), below the CLI
    ("mstar.planner", None, ("mstar.server", "mstar.cli", *FAMILIES, *FAMILY_MODULES)),
]


@pytest.mark.parametrize(("package", "allowed", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_imports_point_down(package, allowed, forbidden):
    bad = []
    for module, imported in _imports().items():
        if not _within(module, package):
            continue
        for name in imported:
            if any(_within(name, f) for f in forbidden):
                bad.append(f"{module} -> {name}")
            elif allowed is not None and name != "mstar" and not any(_within(name, a) for a in allowed):
                bad.append(f"{module} -> {name}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_only_api_and_drivers_import_drivers():
    bad = [f"{m} -> {n}" for m, names in _imports().items() for n in names
           if _within(n, "mstar.runtime.drivers") and not (_within(m, "mstar.runtime.drivers")
                                                           or m == "mstar.runtime.api")
           and _within(m, "mstar.runtime")]
    assert not bad, "\n".join(sorted(bad))


def test_no_function_over_80_lines():
    """Long functions hide their steps: each is split into named ones."""
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := node.end_lineno - node.lineno + 1) > 80:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


def test_the_families_are_found():
    assert {"mstar.models.llama", "mstar.models.qwen3_omni"} <= set(FAMILIES)


def test_the_graph_is_pure_python():
    """``mstar.graph`` never imports torch (or numpy): a model author's graph builds without them."""
    bad = [f"{m} -> {n}" for m, names in _all_imports().items() if _within(m, "mstar.graph")
           for n in names if _within(n, "torch") or _within(n, "numpy")]
    assert not bad, "\n".join(sorted(bad))


def test_only_the_ray_driver_imports_ray():
    bad = [f"{m} -> {n}" for m, names in _all_imports().items() for n in names
           if _within(n, "ray") and m != "mstar.runtime.drivers.ray"]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    """No module imports, directly or through others, a module that imports it back (imports inside
    functions count; ``if TYPE_CHECKING:`` ones do not): each cycle is one module that should be two,
    or a type that belongs below both."""
    graph = _imports(runtime_only=True)
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)
