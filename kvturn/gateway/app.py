"""The gateway's ASGI app: OpenAI-compatible endpoints in front of prefill and decode pools."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from kvturn import control
from kvturn import headers as h
from kvturn.gateway.auth import ApiKeys, scoped_key, tenant_salt
from kvturn.gateway.config import GatewayConfig
from kvturn.gateway.conversations import conversation_table
from kvturn.gateway.errors import (
    BodyTooLarge,
    GatewayError,
    InvalidRequest,
    NoHealthyEngine,
    error_body,
)
from kvturn.gateway.metrics import GatewayMetrics
from kvturn.gateway.pools import Pool, check_health_forever
from kvturn.gateway.replies import Reply, error_reply, send_reply
from kvturn.gateway.response_store import StateUnavailable, response_store
from kvturn.gateway.responses import (
    RESPONSES_PATH,
    Translated,
    assistant_message,
    deleted,
    not_found,
    responses_reply,
    translate,
)
from kvturn.gateway.tokens import CHAT_PATH
from kvturn.gateway.turns.model import Turn
from kvturn.gateway.turns.runner import TurnRunner
from kvturn.gateway.upstream import Upstream, UpstreamUnavailable
from kvturn.gateway.validation import check_request
from kvturn.wire import BLOCK_SIZE_KEY, KV_BYTES_PER_TOKEN_KEY, MAX_LEASE_KEY

logger = logging.getLogger("kvturn.gateway")


class Gateway:
    """Everything one gateway instance owns: pools, table, metrics, upstream client."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.prefill = Pool("prefill", config.prefill)
        self.decode = Pool("decode", config.decode)
        self.upstream = Upstream(
            config.connect_timeout_s, config.request_timeout_s, config.engine_api_key
        )
        self.metrics = metrics = GatewayMetrics()

        def on_state_error(op: str) -> None:
            metrics.state_errors.labels(op).inc()

        #: The conversation table: in this process, or shared in Redis (``config.state``).
        self.store = conversation_table(
            config.state,
            config.max_conversations,
            # An entry is kept while a turn may still run and a lease may still be renewed.
            idle_s=config.request_timeout_s + config.lease_s,
            on_error=on_state_error,
            timeout_s=config.state_timeout_s,
        )
        self.runner = TurnRunner(
            config, self.prefill, self.decode, self.upstream, self.store, self.metrics
        )
        #: Stored Responses API responses, for ``previous_response_id`` and ``GET``.
        self.responses = response_store(
            config.state,
            config.max_responses,
            config.responses_ttl_s,
            on_error=on_state_error,
        )
        self.models: list[dict[str, Any]] = []
        self._health: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._learner: asyncio.Task[None] | None = None

    async def refresh_models(self) -> None:
        for instance in self.prefill.healthy():
            try:
                response = await self.upstream.get(f"{instance.url}/v1/models", timeout_s=5)
            except UpstreamUnavailable:
                continue
            if response.status == 200:
                self.models = list(response.json().get("data") or [])
                return

    async def start(self) -> None:
        """Open the engine client, learn the models, start health checks."""
        if self.config.api_keys.open:
            logger.warning(
                "no API keys configured: the gateway is open, every caller is one tenant "
                "(set KVTURN_API_KEYS or KVTURN_API_KEYS_FILE to require keys)"
            )
        await self.upstream.start()
        await self.refresh_models()
        self._health = asyncio.create_task(
            check_health_forever(
                [self.prefill, self.decode], self.upstream, self.config.health_interval_s
            )
        )
        self._sweeper = asyncio.create_task(self._sweep_forever())
        self._learner = asyncio.create_task(self._learn_decodes())

    async def _learn_decodes(self) -> None:
        """Each decode's block size and KV bytes per token, from its connector (for the
        planner's estimates and the KV-bytes-moved metric), asked every 2 s until every one
        answered."""
        async for attempt in AsyncRetrying(wait=wait_fixed(2.0), retry=retry_if_result(bool)):
            with attempt:
                unknown = await self._learn_decodes_once()
            if not attempt.retry_state.outcome.failed:  # type: ignore[union-attr]
                attempt.retry_state.set_result(unknown)

    async def _learn_decodes_once(self) -> list[str]:
        """Ask the decodes not known yet; those still unknown."""
        unknown = [i for i in self.decode.instances if i.control_url and not i.kv_bytes_per_token]
        for instance in unknown:
            assert instance.control_url is not None
            stats = await self.runner.leases.stats(instance.control_url)
            if stats:
                instance.block_size = int(stats.get(BLOCK_SIZE_KEY) or 0)
                instance.kv_bytes_per_token = int(stats.get(KV_BYTES_PER_TOKEN_KEY) or 0)
                instance.max_lease_s = float(stats.get(MAX_LEASE_KEY) or 0.0)
                if 0 < instance.max_lease_s < self.config.lease_s:
                    logger.warning(
                        "decode %s grants leases of at most %g s, less than the gateway's "
                        "lease (%g s): its conversations are told %g s (set --kv-ttl on the "
                        "engine, or lease_s here, to agree)",
                        instance.url,
                        instance.max_lease_s,
                        self.config.lease_s,
                        instance.max_lease_s,
                    )
        return [i.url for i in unknown if not i.kv_bytes_per_token]

    async def _sweep_forever(self) -> None:
        """Forget conversations that can no longer come back for their KV, a bounded batch a
        second: no turn pays for the table's size. An entry leaves once its lease lapsed and
        nothing touched it for longer than a turn may run plus a lease."""
        idle_s = self.config.request_timeout_s + self.config.lease_s
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            forgotten = self.store.sweep(idle_s, SWEEP_BUDGET)
            if forgotten:
                self.metrics.conversations_forgotten.inc(forgotten)

    async def stop(self) -> None:
        tasks = [t for t in (self._health, self._sweeper, self._learner) if t is not None]
        self._health = self._sweeper = self._learner = None
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.runner.close()
        await self.upstream.close()
        await self.responses.close()
        await self.store.close()


#: How often idle conversations are swept from the table, and at most how many per sweep.
SWEEP_INTERVAL_S = 1.0
SWEEP_BUDGET = 2000

#: The turn endpoints.
TURN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", RESPONSES_PATH})


#: The request headers the turn path reads (ASGI gives names lower-cased, as bytes).
_TURN_HEADERS = {
    name.lower().encode("latin-1"): name
    for name in (h.CONVERSATION_ID, h.SESSION_ID, h.TURN_ID, h.PAUSE_MS, h.PAUSE_KIND)
}
#: Where the authentication middleware leaves the caller's tenant in the ASGI scope.
TENANT_SCOPE_KEY = "kvturn.tenant"


class Authenticate:
    """Every route but ``/health`` needs a valid API key (when the gateway has keys); the
    caller's tenant goes into the scope for the routes."""

    def __init__(self, app: Any, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
            try:
                scope[TENANT_SCOPE_KEY] = self.keys.tenant(authorization)
            except GatewayError as error:
                await _error(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class TurnEndpoint:
    """The turn endpoints (``TURN_PATHS``, POST): a raw ASGI endpoint among the app's routes,
    so the lifespan and every middleware (authentication, and any an operator adds) apply to
    turns as to every other route. It skips Starlette's request and response classes: this
    is the hot path (see :mod:`.replies`)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            body = await _read_body(receive, self.gateway.config.max_body_bytes)
        except GatewayError as error:
            reply = error_reply(error)
        else:
            reply = await serve_turn(
                self.gateway, scope["path"], scope["headers"], body, scope[TENANT_SCOPE_KEY]
            )
        await send_reply(reply, receive, send)


def create_app(config: GatewayConfig) -> Starlette:
    """The gateway as an ASGI app (``app.state.gateway`` is its :class:`Gateway`); the
    gateway's own server (:mod:`.http_server`) runs it, lifespan included."""
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def models(request: Request) -> Response:
        if not gateway.models:
            await gateway.refresh_models()
        if not gateway.models:
            return _error(NoHealthyEngine("no engine answered /v1/models"))
        return JSONResponse({"object": "list", "data": gateway.models})

    async def health(request: Request) -> Response:
        # Turns are served while either pool has an engine (the other side's engine serves
        # a turn alone): ready (200) as long as that holds; ``ok`` says whether both do.
        prefill, decode = bool(gateway.prefill.healthy()), bool(gateway.decode.healthy())
        body = {
            "ok": prefill and decode,
            "prefill": {i.url: i.healthy for i in gateway.prefill.instances},
            "decode": {i.url: i.healthy for i in gateway.decode.instances},
        }
        return JSONResponse(body, status_code=200 if prefill or decode else 503)

    async def metrics(request: Request) -> Response:
        # Counted here, at scrape time (O(table)), never per turn.
        with contextlib.suppress(StateUnavailable):  # counted as a state error; no gauge
            entries, live = await gateway.store.counts()
            gateway.metrics.conversations.set(entries)
            gateway.metrics.live_conversations.set(live)
        await _scrape_decode_leases(gateway)
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    async def status(request: Request) -> Response:
        """What an operator's live view shows (``kvturn top``): the table, the engines, the
        planner's settings and the costs it has learned. Aggregates only, no conversation's
        data."""
        runner = gateway.runner
        engines = []
        for role, pool in (("prefill", gateway.prefill), ("decode", gateway.decode)):
            for instance in pool.instances:
                entry: dict[str, Any] = {
                    "role": role,
                    "url": instance.url,
                    "healthy": instance.healthy,
                    "in_flight": instance.in_flight,
                }
                if role == "decode" and instance.control_url is not None:
                    entry["leases"] = await runner.leases.stats(instance.control_url)
                engines.append(entry)
        config = gateway.config
        entries: int | None
        live: int | None
        try:
            entries, live = await gateway.store.counts()
        except StateUnavailable:
            entries = live = None
        body = {
            # Which process answered, and the turns it served (one of several workers?).
            "process": {"pid": os.getpid(), "turns_served": runner.turns_served},
            "conversations": entries,
            "live_conversations": live,
            "implicit_turns_remembered": runner.implicit.size(),
            "engines": engines,
            "planner": {
                "decode_local": config.decode_local,
                "max_local_suffix_tokens": config.max_local_suffix_tokens,
                "max_local_running": config.max_local_running,
                "local_stall_weight": config.local_stall_weight,
                "local_preference": config.local_preference,
                "implicit_conversations": config.implicit_conversations,
                "lease_s": config.lease_s,
            },
            "costs": runner.costs.snapshot(),
        }
        return JSONResponse(body)

    async def heartbeat(request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        try:
            _check_conversation_id(conversation_id)
            raw = await request.body()
            beat = control.HeartbeatRequest.model_validate_json(raw or b"{}")
        except GatewayError as error:
            return _error(error)
        except ValueError as error:
            return _error(InvalidRequest(f"invalid heartbeat body: {error}"))
        gateway.metrics.heartbeats.inc()
        key = scoped_key(request.scope[TENANT_SCOPE_KEY], conversation_id)
        try:
            conversation = await gateway.store.lookup(key)
        except StateUnavailable as error:
            return _error(error)
        if conversation is None:
            answer = control.HeartbeatResponse(conversation_id=conversation_id, known=False)
        else:
            remaining = 0.0
            holder = gateway.decode.get(conversation.holder_url)
            lease = conversation.holder_request_id
            # What the holder grants, not what the gateway would like: a client that beats at
            # half of a lease the decode cut short would find it lapsed.
            granted = holder.lease_s(config.lease_s) if holder is not None else config.lease_s
            if holder is not None and holder.control_url is not None and lease:
                # The lease lives on the holder decode: renew it there.
                expires_in_s = await gateway.runner.leases.renew(
                    holder.control_url, lease, config.lease_s, beat.pause_kind, beat.paused_ms
                )
                if expires_in_s is None:
                    gateway.metrics.lease_renewals_by["gone"].inc()
                else:
                    gateway.metrics.lease_renewals_by["renewed"].inc()
                try:
                    remaining = await gateway.store.renewed(key, lease, expires_in_s)
                except StateUnavailable as error:
                    return _error(error)
            answer = control.HeartbeatResponse(
                conversation_id=conversation_id,
                known=True,
                lease_remaining_s=round(remaining, 3),
                next_heartbeat_s=(min(granted, remaining) if remaining > 0 else granted) / 2,
            )
        return Response(answer.model_dump_json(), media_type="application/json")

    async def release(request: Request) -> Response:
        conversation_id = request.path_params["conversation_id"]
        try:
            _check_conversation_id(conversation_id)
        except GatewayError as error:
            return _error(error)
        try:
            conversation = await gateway.store.remove(
                scoped_key(request.scope[TENANT_SCOPE_KEY], conversation_id)
            )
        except StateUnavailable as error:
            return _error(error)
        released = conversation is not None
        if conversation is not None:
            gateway.metrics.releases.inc()
            holder = gateway.decode.get(conversation.holder_url)
            key = conversation.holder_request_id
            if holder is not None and holder.control_url is not None and key:
                # Free the blocks on the holder now, not when a lease would lapse.
                await gateway.runner.leases.release(holder.control_url, key)
        answer = control.ReleaseResponse(conversation_id=conversation_id, released=released)
        return Response(answer.model_dump_json(), media_type="application/json")

    async def stored_response(request: Request) -> Response:
        """``GET``/``DELETE /v1/responses/{id}``: a stored response of the caller's tenant."""
        response_id = request.path_params["response_id"]
        tenant = request.scope[TENANT_SCOPE_KEY]
        try:
            if request.method == "DELETE":
                if await gateway.responses.delete(tenant, response_id):
                    return JSONResponse(deleted(response_id))
                return _error(not_found(response_id))
            found = await gateway.responses.get(tenant, response_id)
        except GatewayError as error:
            return _error(error)
        if found is None:
            return _error(not_found(response_id))
        return JSONResponse(found.response)

    async def engine_route(request: Request) -> Response:
        """vLLM's own utility routes (``/version``, ``/tokenize``, ``/detokenize``), answered by
        a prefill engine: the same model, tokenizer and chat template as every engine."""
        body = await request.body()
        for instance in gateway.prefill.healthy():
            try:
                answer = await gateway.upstream.forward(
                    request.method,
                    instance.url + request.url.path,
                    body,
                    request.headers.get("content-type"),
                )
            except UpstreamUnavailable:
                continue
            return Response(
                answer.body,
                status_code=answer.status,
                media_type=answer.headers.get("content-type"),
            )
        return _error(NoHealthyEngine(f"no engine answered {request.url.path}"))

    conversations = "/v1" + control.CONVERSATIONS_PATH
    turn = TurnEndpoint(gateway)
    app = Starlette(
        routes=[
            # The turns first: the router tries routes in order.
            *(Route(path, turn, methods=["POST"]) for path in sorted(TURN_PATHS)),
            Route(RESPONSES_PATH + "/{response_id}", stored_response, methods=["GET", "DELETE"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/version", engine_route, methods=["GET"]),
            Route("/tokenize", engine_route, methods=["POST"]),
            Route("/detokenize", engine_route, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/kvturn/status", status, methods=["GET"]),
            Route(conversations + "/{conversation_id}/heartbeat", heartbeat, methods=["POST"]),
            Route(conversations + "/{conversation_id}", release, methods=["DELETE"]),
        ],
        lifespan=lifespan,
        middleware=[Middleware(Authenticate, keys=config.api_keys)],
        exception_handlers={
            HTTPException: _http_error,  # unknown route, wrong method
            Exception: _unexpected_error,
        },
    )
    app.state.gateway = gateway
    return app


async def serve_turn(
    gateway: Gateway,
    path: str,
    raw_headers: Iterable[tuple[bytes, bytes]],
    raw_body: bytes,
    tenant: str,
) -> Reply:
    """One request to a turn endpoint (``path`` in ``TURN_PATHS``) by an authenticated
    ``tenant``. ``raw_headers`` as ASGI gives them (lower-case names, bytes)."""
    headers: dict[str, str] = {}
    for name, value in raw_headers:
        wanted = _TURN_HEADERS.get(name)
        if wanted is not None:
            headers[wanted] = value.decode("latin-1")
    try:
        # The fields the gateway reads are checked here; everything else about the request is
        # the engine's to judge: prefill refuses a bad request before any work, with vLLM's
        # own error, which the client gets unchanged.
        body = _parse_body(raw_body)
        given = headers.get(h.CONVERSATION_ID)
        if given is None:
            given = headers.get(h.SESSION_ID)
        responses: Translated | None = None
        if path == RESPONSES_PATH:
            # Served as the chat turn it amounts to, and answered the Responses way.
            responses = await translate(body, gateway.responses, tenant)
            path, body = CHAT_PATH, responses.chat
            if given is None:
                given = responses.conversation_id
        check_request(path, body)
        conversation_id = _conversation_id(given, body)
        turn_id = headers.get(h.TURN_ID)
        if turn_id is not None and len(turn_id) > 128:
            raise InvalidRequest("turn id is longer than 128 characters")
        if tenant:
            # Prefix caches (and so reuse) are never shared across tenants.
            body["cache_salt"] = tenant_salt(tenant, body.get("cache_salt"))
        pause = _record_pause(gateway, headers)
        turn = Turn(path, body, conversation_id, turn_id, pause=pause, tenant=tenant)
        reply = await gateway.runner.run(turn)
        if responses is not None:
            return await _responses_reply(gateway, responses, reply, tenant)
        return reply
    except GatewayError as error:
        if error.status >= 500:
            logger.warning("turn failed: %s", error.message)
        return error_reply(error)
    except Exception:
        logger.exception("unexpected error serving %s", path)
        return error_reply(GatewayError("internal gateway error"))


async def _responses_reply(gateway: Gateway, t: Translated, reply: Reply, tenant: str) -> Reply:
    """A chat turn's reply, answered the Responses way; stored (when asked) once complete,
    with the conversation it belonged to, for a turn chained to it."""
    conversation_id = reply.headers.get(h.CONVERSATION_ID)

    async def done(response: dict[str, Any]) -> None:
        reply_message = assistant_message(response["output"])
        history = t.history if reply_message is None else [*t.history, reply_message]
        if t.request.store:
            await gateway.responses.put(tenant, response, history, conversation_id)
        if t.request.conversation is not None and t.conversation_id is not None:
            await gateway.responses.put_conversation(tenant, t.conversation_id, history)

    cached = int(reply.headers.get(h.REUSED_TOKENS, "0") or 0)
    return await responses_reply(t, reply, cached, done)


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _conversation_id(header: str | None, body: dict[str, Any]) -> str | None:
    """From the header (``X-Conversation-Id``, else vllm-router's ``X-Session-ID``), else a
    ``conversation_id`` body field, else OpenAI's ``prompt_cache_key``."""
    value: Any = header
    if value is None:
        value = body.pop("conversation_id", None)
        if value is None:
            value = body.get("prompt_cache_key")
    else:
        body.pop("conversation_id", None)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("conversation id must be a string", param="conversation_id")
    _check_conversation_id(value)
    return value


def _check_conversation_id(value: str) -> None:
    if not h.is_valid_conversation_id(value):
        raise InvalidRequest(
            f"invalid conversation id: 1-{h.CONVERSATION_ID_MAX_LEN} characters of "
            "letters, digits, '.', '_', ':' or '-'",
            param="conversation_id",
        )


async def _scrape_decode_leases(gateway: Gateway) -> None:
    """Each decode connector's lease counts, as metrics of the gateway (they are the truth)."""
    metrics = gateway.metrics
    for instance in gateway.decode.instances:
        if instance.control_url is None:
            continue
        stats = await gateway.runner.leases.stats(instance.control_url)
        if stats is None:
            continue
        metrics.decode_leases.labels(instance.url).set(stats.get("leases", 0))
        metrics.decode_lease_blocks.labels(instance.url).set(stats.get("blocks_held", 0))
        for event in ("retained", "not_retained", "renewed", "claimed"):
            metrics.decode_lease_events.labels(instance.url, event).set(stats.get(event, 0))
        for reason, count in (stats.get("ended") or {}).items():
            metrics.decode_lease_events.labels(instance.url, f"ended_{reason}").set(count)


def _record_pause(gateway: Gateway, headers: dict[str, str]) -> tuple[str, float] | None:
    """The pause the client reports before this turn, if it is a sane one: (kind, ms)."""
    pause_ms = headers.get(h.PAUSE_MS)
    kind = headers.get(h.PAUSE_KIND)
    if pause_ms is None or kind not in ("tool", "user"):
        return None
    try:
        ms = float(pause_ms)
    except ValueError:
        return None
    if not math.isfinite(ms) or ms < 0:
        return None  # nan or inf would poison the histogram (and the decode's pause model)
    ms = min(ms, h.MAX_PAUSE_MS)  # 1e308 is a week, not a value to skew eviction with
    gateway.metrics.pauses_by[kind].observe(ms / 1000)
    return kind, ms


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = error_body(f"{request.method} {request.url.path}: {exc.detail}", kind)
    return Response(orjson.dumps(body), status_code=exc.status_code, media_type="application/json")


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error serving %s", request.url.path)
    return _error(GatewayError("internal gateway error"))


def _error(error: GatewayError) -> Response:
    return Response(
        orjson.dumps(error.body()), status_code=error.status, media_type="application/json"
    )
