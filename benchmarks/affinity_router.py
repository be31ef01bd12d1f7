"""Decode-affinity: the router llm-d and Dynamo users already run, for the benchmarks to beat.

What it reproduces (documented router behaviour, no kvturn in it):

* **llm-d's P/D decider** (the inference scheduler's ``pd-profile-handler`` with its
  ``threshold`` on non-cached tokens, fed by the ``prefix-cache-scorer``): a request whose
  prompt is mostly in the chosen decode's prefix cache runs on that decode alone; any other
  goes through prefill, and decode reads its KV (NIXL). Dynamo's conditional disaggregation
  (``isl_bounding``) makes the same decision from its KV router's overlap.
* **The prefix-cache scorer in its approximate mode**: the router indexes the prompts it sends
  to each decode, as chained hashes of whole blocks of token ids, in an LRU as large as that
  decode's KV cache (``--decode-blocks``); a request's cached tokens are its leading blocks
  found there. Nothing is leased or retained beyond vLLM's own LRU prefix cache; nothing is
  released; there is no SDK and no pause signal. Replies are not indexed (the approximate
  scorer sees prompts only): a turn's non-cached part counts the previous reply, which
  ``--threshold`` leaves room for.
* **Session affinity**: a session (``X-Session-ID``) is placed on a decode by rendezvous hash,
  as vllm-router's ``consistent_hash`` does; with one decode, every session is there.

The P/D exchange is vLLM's (its example proxies'): prefill with ``max_tokens=1``, not streamed,
``kv_transfer_params={"do_remote_decode": true, ...}``; decode with prefill's answer's
``kv_transfer_params``, streamed back unchanged. Token ids come from the decode engine's own
``/tokenize`` (the scheduler's ``tokenizer`` plugin does the same work).

    .venv/bin/python benchmarks/affinity_router.py --prefill URL --decode URL --port 29400
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvturn.wire import PREFILL_FOR_REMOTE_DECODE

SESSION_HEADER = "x-session-id"
#: The documented example threshold of llm-d's ``pd-profile-handler`` (non-cached tokens below
#: which a request runs on decode alone).
DEFAULT_THRESHOLD = 500
#: vLLM's P/D request to prefill (its NixlConnector protocol), as kvturn's wire declares it.
PD_PREFILL_PARAMS = PREFILL_FOR_REMOTE_DECODE


class BlockIndex:
    """Which prompt blocks a decode was sent, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int, block_size: int):
        self.capacity = capacity
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def hashes(self, ids: list[int]) -> list[bytes]:
        chained, out = b"", []
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            block = ids[start : start + self.block_size]
            chained = hashlib.blake2b(chained + json.dumps(block).encode(), digest_size=16).digest()
            out.append(chained)
        return out

    def cached_tokens(self, hashes: list[bytes]) -> int:
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            hit += 1
        return hit * self.block_size

    def record(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class AffinityRouter:
    def __init__(self, args: argparse.Namespace):
        self.prefill: list[str] = args.prefill
        self.decode: list[str] = args.decode
        self.threshold: int = args.threshold
        self.index = {d: BlockIndex(args.decode_blocks, args.block_size) for d in self.decode}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10))
        self.counts = {"decode-only": 0, "pd": 0}

    @staticmethod
    def placed(urls: list[str], session: str) -> str:
        """The session's engine among ``urls``, by rendezvous hash."""
        return max(
            urls,
            key=lambda url: hashlib.blake2b(f"{url}\0{session}".encode(), digest_size=8).digest(),
        )

    async def token_ids(self, decode: str, body: dict[str, Any]) -> list[int]:
        ask = {"model": body.get("model"), "messages": body.get("messages", [])}
        for key in ("tools", "chat_template_kwargs", "add_generation_prompt"):
            if key in body:
                ask[key] = body[key]
        answer = await self.client.post(f"{decode}/tokenize", json=ask)
        answer.raise_for_status()
        return list(answer.json()["tokens"])

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        session = request.headers.get(SESSION_HEADER, "")
        decode = self.placed(self.decode, session)
        index = self.index[decode]
        ids = await self.token_ids(decode, body)
        hashes = index.hashes(ids)
        non_cached = len(ids) - index.cached_tokens(hashes)
        decode_body = dict(body)
        if non_cached > self.threshold:
            self.counts["pd"] += 1
            prefill = self.placed(self.prefill, session)
            ask = {k: v for k, v in body.items() if k != "stream_options"}
            ask.update(
                stream=False, max_tokens=1, max_completion_tokens=1,
                kv_transfer_params=dict(PD_PREFILL_PARAMS),
            )  # fmt: skip
            answer = await self.client.post(f"{prefill}/v1/chat/completions", json=ask)
            if answer.status_code != 200:
                return Response(answer.content, answer.status_code, media_type="application/json")
            decode_body["kv_transfer_params"] = answer.json().get("kv_transfer_params")
        else:
            self.counts["decode-only"] += 1
        index.record(hashes)
        url = f"{decode}/v1/chat/completions"
        if not body.get("stream"):
            answer = await self.client.post(url, json=decode_body)
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = await self.client.send(
            self.client.build_request("POST", url, json=decode_body), stream=True
        )
        return streamed(upstream)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", **self.counts})


def streamed(
    upstream: httpx.Response, after: Callable[[], Awaitable[None]] | None = None
) -> StreamingResponse:
    """Decode's streamed answer relayed to the client as it comes, with its status and content
    type; once it ends (or the client leaves), the upstream response is closed and ``after``
    runs."""

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            if after is not None:
                await after()

    return StreamingResponse(
        relay(), upstream.status_code, media_type=upstream.headers.get("content-type")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True)
    parser.add_argument("--decode", action="append", required=True)
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument(
        "--threshold",
        type=int,
        default=DEFAULT_THRESHOLD,
        help="non-cached tokens at or below which a request runs on decode alone",
    )
    parser.add_argument(
        "--decode-blocks",
        type=int,
        required=True,
        help="each decode's KV cache, in blocks (the index's LRU capacity)",
    )
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()
    router = AffinityRouter(args)
    serve(router.chat, router.health, args.port)


def serve(chat: Any, health: Any, port: int) -> None:
    """A router's chat completions and health routes on ``port`` of the loopback."""
    app = Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ])  # fmt: skip
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
