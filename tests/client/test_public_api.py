"""The public surface of kvturn.client, and what it may import."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import kvturn.client

CLIENT_DIR = pathlib.Path(kvturn.client.__file__).parent


def test_public_names_are_exactly_these() -> None:
    assert set(kvturn.client.__all__) == {
        "DEFAULT_LEASE_SECONDS",
        "DEFAULT_MAX_PAUSE_SECONDS",
        "AsyncConversationScope",
        "AsyncOpenAI",
        "Clock",
        "Conversation",
        "ConversationScope",
        "KvturnSettings",
        "OpenAI",
        "Pause",
        "Turn",
        "conversation_id_from",
        "current_conversation",
    }
    for name in kvturn.client.__all__:
        assert hasattr(kvturn.client, name)


def test_client_source_never_imports_gateway_or_connector() -> None:
    offenders = []
    for path in CLIENT_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [
                f"{path.name}: {n}"
                for n in names
                if n.startswith(("kvturn.gateway", "kvturn.connector", "vllm"))
            ]
    assert offenders == []


def test_importing_the_client_loads_no_server_code_or_adapters() -> None:
    code = (
        "import sys, kvturn.client; "
        "bad = [m for m in sys.modules if m.startswith(('kvturn.gateway', 'kvturn.connector',"
        " 'vllm', 'agents', 'langchain', 'langgraph', 'starlette'))]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_kvturn_names_do_not_shadow_the_sdk() -> None:
    import openai

    added = {"conversation", "release_conversation", "kvturn_settings", "kvturn_conversations"}
    for base in (openai.OpenAI, openai.AsyncOpenAI):
        assert not added & set(dir(base))
    client = kvturn.client.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    # The SDK's own Conversations API resource (openai 1.101 and later) is still there.
    if "conversations" in dir(openai.OpenAI):
        assert type(client.conversations).__name__ == "Conversations"
    client.close()
