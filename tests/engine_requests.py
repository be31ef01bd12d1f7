"""Requests against real engines that several test modules share."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from kvturn.kv_params import PREFILL_FOR_REMOTE_DECODE as PREFILL_PARAMS

__all__ = ["PREFILL_PARAMS", "chat", "long_prompt", "metric_total", "single_engine_ids"]


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
