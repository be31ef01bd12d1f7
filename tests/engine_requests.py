"""Requests against real engines that several test modules share."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvturn.gateway.ops.launch.engines import EngineSpec, KVSettings
from kvturn.wire import PREFILL_FOR_REMOTE_DECODE as PREFILL_PARAMS

if TYPE_CHECKING:
    from tests.conftest import LocalPair

__all__ = [
    "KV_BYTES_PER_TOKEN",
    "PREFILL_PARAMS",
    "NixlReads",
    "chat",
    "kv_usage",
    "long_prompt",
    "metric_total",
    "single_engine_completion_ids",
    "single_engine_ids",
]

#: The tiny test model's KV per token in float32: 4 layers x (K, V) x 2 heads x 64 dims x 4 B.
KV_BYTES_PER_TOKEN = 4096


def long_prompt(tokens: int, topic: str = "turtles") -> str:
    """Text of about ``tokens`` tokens for the tiny model (byte-level: one character each)."""
    text = f"Tell me everything about {topic}, slowly and in detail. " * (tokens // 40 + 1)
    return text[:tokens]


def varied_prompt(tokens: int, seed: int) -> str:
    """Like :func:`long_prompt`, but no sentence repeats: seeded random words, so that a block
    of its KV never equals another block's, shifted or not."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < tokens:
        words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
    return " ".join(words)[:tokens]


def chat(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
    response.raise_for_status()
    return response.json()


def single_engine_ids(
    url: str, model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
) -> list[int]:
    """Greedy output token ids of one engine alone; a fresh cache salt rules out cached KV.

    The reference every reuse test compares with: nothing of the gateway's path (no
    transfer, no prefix cache another request filled) can have touched it."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "cache_salt": uuid.uuid4().hex, **extra,
    }  # fmt: skip
    return list(chat(url, body)["choices"][0]["token_ids"])


def single_engine_completion_ids(url: str, model: str, prompt: str, max_tokens: int) -> list[int]:
    """:func:`single_engine_ids` for ``/v1/completions``."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "cache_salt": uuid.uuid4().hex,
    }  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


class NixlReads:
    """The NIXL reads an engine made, from its ``/metrics``: proof that a pull happened.

    In kvturn's P/D, prefill reads only when it pulls a conversation's history from a decode
    (decode's own reads of each new prompt count on decode), so prefill's count and bytes
    rising is the evidence of reuse that a plan header alone is not."""

    COUNT = "vllm:nixl_xfer_time_seconds_count"
    BYTES = "vllm:nixl_bytes_transferred_sum"

    def __init__(self, engine_url: str):
        self.url = engine_url
        self.count, self.bytes = self._read()

    def _read(self) -> tuple[float, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return metric_total(text, self.COUNT), metric_total(text, self.BYTES)

    def wait_for(self, reads: int, min_bytes: float = 0, timeout_s: float = 90) -> float:
        """Wait until at least ``reads`` more reads moved ``min_bytes`` more bytes; return the
        bytes moved. vLLM publishes transfer stats on its logging tick (about 10 s), hence
        the polling; the deadline only matters when the reads never come."""
        deadline = time.monotonic() + timeout_s
        while True:
            count, moved = self._read()
            done = count - self.count >= reads and moved - self.bytes >= min_bytes
            if done or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert count - self.count >= reads, f"{count - self.count:g} NIXL reads, not {reads}"
        assert moved - self.bytes >= min_bytes, f"{moved - self.bytes:g} bytes, not {min_bytes}"
        return moved - self.bytes


def metric_total(metrics_text: str, name: str) -> float:
    """Sum of every sample of metric ``name`` (all label sets) in Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_usage(engine_url: str) -> float:
    """A vLLM engine's KV cache usage (its ``vllm:kv_cache_usage_perc`` gauge, 0 to 1)."""
    text = httpx.get(engine_url + "/metrics", timeout=30).text
    return metric_total(text, "vllm:kv_cache_usage_perc")


def extra_decode_spec(pair: LocalPair, offset: int, **overrides: Any) -> EngineSpec:
    """A decode engine beside the session pair (its model, its retention), on ports
    ``TEST_BASE_PORT + offset`` (+100: NIXL's side channel, +200: kvturn's control server);
    ``overrides`` replace any field."""
    from tests.conftest import TEST_BASE_PORT, TEST_KV_TTL_S

    spec = EngineSpec(
        role="decode",
        model=Path(str(pair.state["model_path"])),
        served_model_name=pair.model,
        port=TEST_BASE_PORT + offset,
        side_channel_port=TEST_BASE_PORT + 100 + offset,
        control_port=TEST_BASE_PORT + 200 + offset,
        cpu=0,
        kv=KVSettings(decoder_kv_blocks_ttl_s=TEST_KV_TTL_S),
    )
    return replace(spec, **overrides)
