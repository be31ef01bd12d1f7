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
