"""Upstream bidirectional: the seeds' own system, for the benchmarks to beat.

vLLM's NixlConnector with ``bidirectional_kv_xfer`` keeps every finished decode request's blocks
for a fixed TTL (``decoder_kv_blocks_ttl``, 480 s), and vLLM's multi-turn example proxy
(``disagg_proxy_multiturn.py``) hands them back to prefill on the conversation's next turn:

* it keys a conversation on its id (the example reads a ``conversation_id`` body field; AIPerf
  and vllm-router use the ``X-Session-ID`` header, which this proxy reads);
* it keeps the decode's last ``kv_transfer_params`` per conversation for 450 s and consumes
  them on the next turn (one read per handle): prefill gets them, pulls the history over NIXL
  (what it lacks past its own prefix cache) and computes the rest; decode then reads the prompt
  from prefill as in plain P/D and streams the reply;
* nothing renews or releases the blocks: they stay until read or until the TTL lapses.

The engines run kvturn's connector with ``--retain-untracked`` (``kvturn up``): requests that
no kvturn gateway sent keep upstream's semantics, a fixed TTL, never reclaimed, with the same
CPU fixes as every other mode here. On vLLM 0.32 a streamed reply carries no
``kv_transfer_params`` (0.33 puts them on its final chunk), so the example proxy never reuses
unless decode's requests are made whole, which would hold every first token until the reply's
end. This proxy streams and reads the params from the connector's control server once the
stream has ended, off the client's path: what 0.33 hands over, a stronger baseline than whole
replies. A pull that prefill fails (the blocks lapsed on the way) is retried once as plain
P/D, where the example proxy would fail the turn.

    .venv/bin/python benchmarks/bidirectional_proxy.py --prefill URL --decode URL \
        --decode-control URL --port 29500      # KVTURN_CONTROL_SECRET in the environment
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import httpx
from affinity_router import PD_PREFILL_PARAMS, SESSION_HEADER, AffinityRouter, serve, streamed
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvturn.wire import CONTROL_SECRET_ENV, EXPIRES_IN_KEY, control_authorization, retained_path

#: How long the example proxy keeps a conversation's params (s): under decode's 480 s TTL.
HANDLE_S = 450.0


class BidirectionalProxy:
    def __init__(self, args: argparse.Namespace):
        self.prefill: list[str] = args.prefill
        self.decode: list[str] = args.decode
        self.control = dict(zip(args.decode, args.decode_control, strict=True))
        secret = os.environ.get(CONTROL_SECRET_ENV, "")
        self.auth = {"authorization": control_authorization(secret)} if secret else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10))
        #: conversation -> (decode's last params, until when they are used)
        self.handles: dict[str, tuple[dict[str, Any], float]] = {}
        self.counts = {"pulled": 0, "plain": 0, "retried": 0}

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        session = request.headers.get(SESSION_HEADER, "")
        handle = self.handles.pop(session, None)  # one read per handle
        params = PD_PREFILL_PARAMS
        if handle is not None and time.monotonic() < handle[1]:
            params = handle[0]
        prefill = AffinityRouter.placed(self.prefill, session)
        ask = {k: v for k, v in body.items() if k != "stream_options"}
        ask.update(stream=False, max_tokens=1, max_completion_tokens=1, kv_transfer_params=params)
        answer = await self.client.post(f"{prefill}/v1/chat/completions", json=ask)
        if params is not PD_PREFILL_PARAMS and answer.status_code >= 500:
            self.counts["retried"] += 1
            ask["kv_transfer_params"] = dict(PD_PREFILL_PARAMS)
            answer = await self.client.post(f"{prefill}/v1/chat/completions", json=ask)
        else:
            self.counts["pulled" if params is not PD_PREFILL_PARAMS else "plain"] += 1
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type="application/json")
        decode = AffinityRouter.placed(self.decode, session)
        decode_body = {**body, "kv_transfer_params": answer.json().get("kv_transfer_params")}
        rid = f"bidi-{uuid.uuid4().hex}"
        built = self.client.build_request(
            "POST", f"{decode}/v1/chat/completions", json=decode_body,
            headers={"X-Request-Id": rid},
        )  # fmt: skip
        upstream = await self.client.send(built, stream=True)
        return streamed(upstream, after=lambda: self.remember(session, decode, rid))

    async def remember(self, session: str, decode: str, rid: str) -> None:
        """The params decode retained the turn's KV under, for the conversation's next turn."""
        url = self.control[decode] + retained_path(rid, 0.5)
        answer = await self.client.get(url, headers=self.auth)
        if answer.status_code == 200:
            params = dict(answer.json())
            params.pop(EXPIRES_IN_KEY, None)
            self.handles[session] = (params, time.monotonic() + HANDLE_S)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", **self.counts})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True)
    parser.add_argument("--decode", action="append", required=True)
    parser.add_argument("--decode-control", action="append", required=True)
    parser.add_argument("--port", type=int, default=29500)
    args = parser.parse_args()
    proxy = BidirectionalProxy(args)
    serve(proxy.chat, proxy.health, args.port)


if __name__ == "__main__":
    main()
