"""Requests against real engines that several test modules share."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

#: What a proxy sends to prefill so that decode can pull the KV (vLLM's P/D protocol).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def long_prompt(tokens: int, topic: str = "turtles") -> str:
    """Text of about ``tokens`` tokens for the tiny model (byte-level: one character each)."""
    text = f"Tell me everything about {topic}, slowly and in detail. " * (tokens // 40 + 1)
    return text[:tokens]


def chat(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
    response.raise_for_status()
    return response.json()


def single_engine_ids(
    url: str, model: str, messages: list[dict[str, Any]], max_tokens: int
) -> list[int]:
    """Greedy output token ids of one engine alone; a fresh cache salt rules out cached KV."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "cache_salt": uuid.uuid4().hex,
    }  # fmt: skip
    return list(chat(url, body)["choices"][0]["token_ids"])


def metric_total(metrics_text: str, name: str) -> float:
    """Sum of every sample of metric ``name`` (all label sets) in Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
