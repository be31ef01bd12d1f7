"""The gateway's floors: the operator's tools (``kvturn.gateway.ops``) use the gateway and are
never imported by it, the HTTP plumbing (``kvturn.gateway.http``) knows nothing of the gateway
but its error bodies, and every module says what it owns. (No import cycles and the sizes a
reader holds: ``test_layout.py``, for the whole package.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "kvturn" / "gateway"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(GATEWAY.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The gateway modules ``name`` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # ``from package import module``
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def test_the_gateway_never_imports_its_operator_tools() -> None:
    ops = "kvturn.gateway.ops"
    offenders = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if not name.startswith(ops)
        for target in targets
        if target.startswith(ops)
    ]
    assert offenders == []


def test_the_http_plumbing_knows_only_the_error_bodies() -> None:
    http = "kvturn.gateway.http"
    allowed = {"kvturn.gateway", "kvturn.gateway.errors"}
    offenders = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.startswith(http)
        for target in targets
        if not target.startswith(http) and target not in allowed
    ]
    assert offenders == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_says_what_it_owns(name: str) -> None:
    tree = ast.parse(MODULES[name].read_text())
    assert ast.get_docstring(tree), f"{name} has no docstring saying what it owns"
