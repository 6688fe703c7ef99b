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


def _imports() -> dict[str, set[str]]:
    """Every mstar module -> the mstar modules it imports (lazy imports inside functions included)."""
    out: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        out[_module_name(path)] = {n for n in names if n == "mstar" or n.startswith("mstar.")}
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# (importer package, packages it may import from mstar; None = no limit beyond the forbidden list,
#  packages it must not import)
ALLOWED_RUNTIME_BOTTOM = ("mstar.runtime.failures", "mstar.runtime.keys", "mstar.runtime.work_items")
RULES: list[tuple[str, tuple[str, ...] | None, tuple[str, ...]]] = [
    ("mstar.graph", ("mstar.graph",), ()),
    ("mstar.model", None, ("mstar.runtime", "mstar.server", "mstar.cli")),
    ("mstar.layers", None, ("mstar.runtime", "mstar.server", "mstar.cli", "mstar.models")),
    ("mstar.models", None, ("mstar.runtime", "mstar.server", "mstar.cli")),
    ("mstar.runtime", None, ("mstar.server", "mstar.cli")),
    ("mstar.runtime.wire", ("mstar.runtime.wire", *ALLOWED_RUNTIME_BOTTOM, "mstar.graph", "mstar.model",
                            "mstar.placement"), ()),
    ("mstar.runtime.kv", ("mstar.runtime.kv", "mstar.runtime.engine", *ALLOWED_RUNTIME_BOTTOM, "mstar.layers",
                          "mstar.model", "mstar.graph"), ()),
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
