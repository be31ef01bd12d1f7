"""Helpers for driving the gateway with the official openai client in tests."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.server import GatewayThread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_fake_engine() -> Iterator[str]:
    """tests/fake_engine.py on a free port (both roles); yields its base URL."""
    import threading
    import time

    import uvicorn

    from tests import fake_engine

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_engine.app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


class ChunkStream:
    """A :class:`~kvturn.gateway.replies.ReplyStream` that hands out fixed byte chunks, and
    counts how often it was closed."""

    def __init__(self, *chunks: bytes):
        self.chunks = list(chunks)
        self.closed = 0

    @property
    def at_end(self) -> bool:
        return not self.chunks

    async def next_chunk(self) -> bytes | None:
        return self.chunks.pop(0) if self.chunks else None

    async def aclose(self) -> None:
        self.closed += 1


@dataclass
class RedisServer:
    """A real ``redis-server`` (Debian's package) of one test: no persistence, loopback."""

    port: int
    process: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import shutil
        import subprocess
        import time

        binary = shutil.which("redis-server")
        if binary is None:
            if os.environ.get("KVTURN_SKIP_REDIS_TESTS") == "1":
                pytest.skip("redis-server is missing (KVTURN_SKIP_REDIS_TESTS=1)")
            pytest.fail(
                "redis-server is missing: scripts/setup.sh installs it (as root or with sudo); "
                "without root, KVTURN_SKIP_REDIS_TESTS=1 skips the tests that need it"
            )
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return self
            assert self.process.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not start in 20 s"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A real Redis on a free port for the test; stopped (by its pid) afterwards."""
    server = RedisServer(free_port()).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_gateway(config: GatewayConfig) -> Iterator[GatewayThread]:
    """A gateway with ``config`` on a free loopback port, for one test."""
    gateway = GatewayThread(config, port=free_port()).start()
    try:
        yield gateway
    finally:
        gateway.stop()


@dataclass
class TurnResult:
    text: str
    plan: str | None
    reused_tokens: int
    prompt_tokens: int
    completion_tokens: int
    tool_calls: list[Any]
    finish_reason: str | None
    #: The reply's token ids (vLLM's ``return_token_ids``), to compare with a reference.
    token_ids: list[int]
    #: Why the gateway chose the plan (``X-Kvturn-Plan-Reason``).
    reason: str | None = None


def run_turn(
    client: openai.OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    conversation_id: str | None = None,
    stream: bool = True,
    max_tokens: int = 16,
    **extra: Any,
) -> TurnResult:
    """One greedy turn through the gateway; returns the reply and what the gateway did."""
    headers = {"X-Conversation-Id": conversation_id} if conversation_id else None
    kwargs: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "extra_headers": headers, **extra,
        "extra_body": {"return_token_ids": True, **extra.get("extra_body", {})},
    }  # fmt: skip
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    raw = client.chat.completions.with_raw_response.create(stream=stream, **kwargs)
    plan = raw.headers.get("x-kvturn-plan")
    reused = int(raw.headers.get("x-kvturn-reused-tokens", "0"))
    if not stream:
        completion = raw.parse()
        choice = completion.choices[0]
        return TurnResult(
            choice.message.content or "", plan, reused, completion.usage.prompt_tokens,
            completion.usage.completion_tokens, list(choice.message.tool_calls or []),
            choice.finish_reason, list(getattr(choice, "token_ids", None) or []),
            raw.headers.get("x-kvturn-plan-reason"),
        )  # fmt: skip
    text, finish, usage, token_ids = "", None, None, []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            token_ids += getattr(choice, "token_ids", None) or []
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert usage is not None, "stream carried no usage chunk"
    tool_calls = [_tool_call(calls[i]) for i in sorted(calls)]
    return TurnResult(
        text, plan, reused, usage.prompt_tokens, usage.completion_tokens, tool_calls, finish,
        token_ids, raw.headers.get("x-kvturn-plan-reason"),
    )  # fmt: skip


def _tool_call(streamed: dict[str, Any]) -> Any:
    """A streamed tool call put together, as the SDK's non-streamed message holds one."""
    from openai.types.chat import ChatCompletionMessageFunctionToolCall

    return ChatCompletionMessageFunctionToolCall.model_validate({
        "id": streamed["id"], "type": "function",
        "function": {"name": streamed["name"], "arguments": streamed["arguments"]},
    })  # fmt: skip


def wait_recorded(gateway: GatewayThread, conversation_id: str) -> Any:
    """The conversation's entry once its last turn's KV location is recorded (just after the
    reply: the gateway learns it from decode in the background)."""
    import time

    from kvturn.gateway.auth import scoped_key

    store = gateway.app.state.gateway.store
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conversation = store.peek(scoped_key("", conversation_id))
        if conversation is not None and conversation.holder_request_id is not None:
            return conversation
        time.sleep(0.05)
    raise AssertionError(f"{conversation_id}: KV location never recorded")


def metric(url: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric served at ``url``."""
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def vllm_auth_middleware() -> Any:
    """vLLM's own ``AuthenticationMiddleware`` class (what ``--api-key`` adds to its API
    server), loaded from the installed wheel's file alone: importing the whole ``vllm`` package
    takes seconds. Skips the test where vLLM is not installed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = Path(spec.submodule_search_locations[0], "entrypoints/serve/middleware/authenticate.py")
    if not path.exists():
        pytest.skip(f"no {path}: another vLLM layout")
    module_spec = importlib.util.spec_from_file_location("_vllm_authenticate", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.AuthenticationMiddleware
