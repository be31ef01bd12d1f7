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
