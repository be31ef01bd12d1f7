"""The three packages share only the contract package, and the contract stays small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: folder → import prefixes it must never reach (directly, at any depth of its own modules;
#: "kvturn" is the shared contract: the modules directly in kvturn/, not its three packages).
FORBIDDEN = {
    "kvturn": ("kvturn.client", "kvturn.gateway", "kvturn.connector", "vllm", "openai", "httpx"),
    "kvturn/client": ("kvturn.gateway", "kvturn.connector", "vllm", "starlette", "uvicorn"),
    "kvturn/gateway": ("kvturn.client", "kvturn.connector", "vllm"),
    "kvturn/connector": (
        *("kvturn.client", "kvturn.gateway"),
        *("starlette", "uvicorn", "fastapi", "openai"),
    ),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_dependency_direction(folder: str) -> None:
    offenders = []
    paths = (ROOT / folder).glob("*.py") if folder == "kvturn" else (ROOT / folder).rglob("*.py")
    for path in sorted(paths):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_contract_package_is_small_and_typed() -> None:
    import kvturn
    from kvturn import control, headers, kv_params

    assert kvturn.__all__ == ["__version__"]
    assert headers.CONVERSATION_ID == "X-Conversation-Id"
    assert control.heartbeat_path("c") == "/kvturn/conversations/c/heartbeat"
    assert kv_params.PREFIX_DIGESTS_KEY == "kvturn_prefix_digests"


#: The sizes a reader can hold in mind: a module, a class (issue 36's house rules).
MAX_GATEWAY_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name."""
    found = {}
    for path in (ROOT / "kvturn").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in it: at the top, in a function, or
    under ``TYPE_CHECKING`` (a cycle there is still a cycle in what the reader must hold)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imported_modules(name, path, modules) for name, path in modules.items()}
    cycles = []
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append([*trail[trail.index(name) :], name])
            return
        if name in done:
            return
        for other in sorted(graph[name]):
            visit(other, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_gateway_modules_and_every_class_stay_small() -> None:
    too_long = []
    for name, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text())
        lines = len(path.read_text().splitlines())
        if name.startswith("kvturn.gateway") and lines > MAX_GATEWAY_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_CLASS_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert too_long == []


#: What the state wing (``kvturn/gateway/state``) may import of kvturn: itself, the gateway's
#: typed errors and the contract. It is below the turn path, the app and the HTTP server (they
#: use it; it names none of them, whatever modules they are split into).
STATE_MAY_IMPORT = ("kvturn.gateway.state", "kvturn.gateway.errors")


def test_only_the_state_wing_talks_to_redis_and_it_is_below_the_turn_path() -> None:
    state = ROOT / "kvturn" / "gateway" / "state"
    contract = {f"kvturn.{p.stem}" for p in (ROOT / "kvturn").glob("*.py")}
    offenders = []
    for path in sorted((ROOT / "kvturn").rglob("*.py")):
        inside = state in path.parents
        for name in _imports(path):
            if (name == "redis" or name.startswith("redis.")) and not inside:
                offenders.append(f"{path.relative_to(ROOT)} imports {name} (only state may)")
            if inside and (name == "kvturn" or name.startswith("kvturn.")):
                allowed = name in contract or any(
                    name == a or name.startswith(a + ".") for a in STATE_MAY_IMPORT
                )
                if not allowed:
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []
    # Every state module imports its siblings absolutely (a relative import would slip by).
    for path in state.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]


def test_the_state_scripts_ship_with_the_package() -> None:
    import tomllib

    from kvturn.gateway.state import lua

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (
        "scripts/*.lua" in pyproject["tool"]["setuptools"]["package-data"]["kvturn.gateway.state"]
    )
    shipped = {p.stem for p in (ROOT / "kvturn" / "gateway" / "state" / "scripts").glob("*.lua")}
    assert shipped == {*lua.NAMES, "make"}
    assert all("redis.call" in lua.script(name) for name in lua.NAMES)
