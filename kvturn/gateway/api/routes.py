"""The gateway's routes besides the turns: models, health, metrics, the operator's status, a
conversation's heartbeat and release (the control API, :mod:`kvturn.control`), stored
Responses, and vLLM's utility routes relayed to a prefill engine. Each handler finds the
:class:`~kvturn.gateway.instance.Gateway` in the app's state."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvturn import control
from kvturn.gateway.api.authenticate import TENANT_SCOPE_KEY
from kvturn.gateway.api.error_responses import error_response
from kvturn.gateway.api.turn import check_conversation_id
from kvturn.gateway.auth import scoped_key
from kvturn.gateway.errors import GatewayError, InvalidRequest, NoHealthyEngine, StateUnavailable
from kvturn.gateway.http.upstream import UpstreamUnavailable
from kvturn.gateway.instance import Gateway
from kvturn.gateway.responses.objects import deleted
from kvturn.gateway.responses.translate import not_found
from kvturn.gateway.scrapes import Rendered


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def models(request: Request) -> Response:
    gateway = _gateway(request)
    if not gateway.models:
        await gateway.refresh_models()
    if not gateway.models:
        return error_response(NoHealthyEngine("no engine answered /v1/models"))
    return JSONResponse({"object": "list", "data": gateway.models})


async def health(request: Request) -> Response:
    gateway = _gateway(request)
    # Turns are served while either pool has an engine (the other side's engine serves
    # a turn alone): ready (200) as long as that holds; ``ok`` says whether both do.
    prefill, decode = bool(gateway.prefill.healthy()), bool(gateway.decode.healthy())
    body = {
        "ok": prefill and decode,
        "prefill": {i.url: i.healthy for i in gateway.prefill.instances},
        "decode": {i.url: i.healthy for i in gateway.decode.instances},
        # Engines about to stop: answering, taking no new turns (kvturn.wire.DRAIN_PATH).
        "draining": [
            i.url for p in (gateway.prefill, gateway.decode) for i in p.instances if i.draining
        ],
    }
    return JSONResponse(body, status_code=200 if prefill or decode else 503)


async def metrics(request: Request) -> Response:
    gateway = _gateway(request)
    return _response(await gateway.scrapes["metrics"].answer(lambda: _metrics(gateway)))


async def _metrics(gateway: Gateway) -> Rendered:
    # Counted here, at scrape time: O(1) (the table keeps its counts as entries change).
    with contextlib.suppress(StateUnavailable):  # counted as a state error; no gauge
        entries, live = await gateway.store.counts()
        gateway.metrics.conversations.set(entries)
        gateway.metrics.live_conversations.set(live)
    await _scrape_decode_leases(gateway)
    return Rendered(200, gateway.metrics.render(), "text/plain; version=0.0.4")


async def status(request: Request) -> Response:
    """What an operator's live view shows (``kvturn top``): the table, the engines, the
    planner's settings and the costs it has learned. Aggregates only, no conversation's
    data."""
    gateway = _gateway(request)
    return _response(await gateway.scrapes["status"].answer(lambda: _status(gateway)))


def _response(rendered: Rendered) -> Response:
    return Response(rendered.body, rendered.status, media_type=rendered.media_type)


async def _status(gateway: Gateway) -> Rendered:
    runner = gateway.runner
    engines = []
    for role, pool in (("prefill", gateway.prefill), ("decode", gateway.decode)):
        for instance in pool.instances:
            entry: dict[str, Any] = {
                "role": role,
                "url": instance.url,
                "healthy": instance.healthy,
                "draining": instance.draining,
                "in_flight": instance.in_flight,
            }
            if role == "decode" and instance.control_url is not None:
                entry["leases"] = await runner.context.leases.stats(instance.control_url)
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
        "implicit_turns_remembered": gateway.store.implicit.size(),
        "engines": engines,
        "planner": {
            "decode_local": config.decode_local,
            "max_local_suffix_tokens": config.max_local_suffix_tokens,
            "max_local_running": config.max_local_running,
            "local_stall_weight": config.local_stall_weight,
            "local_preference": config.local_preference,
            "local_stall_budget_s": config.local_stall_budget_s,
            "pull_priority": config.pull_priority,
            "implicit_conversations": config.implicit_conversations,
            "shared_prefixes": config.shared_prefixes,
            "lease_s": config.lease_s,
            "heartbeat_lease_s": config.heartbeat_lease_s,
            "learned_lease": config.learned_lease,
        },
        "costs": runner.context.costs.snapshot(),
    }
    return Rendered(200, orjson.dumps(body), "application/json")


async def heartbeat(request: Request) -> Response:
    """A client's heartbeat: the conversation's lease renewed on the decode holding its KV."""
    gateway = _gateway(request)
    config = gateway.config
    conversation_id = request.path_params["conversation_id"]
    try:
        check_conversation_id(conversation_id)
        raw = await request.body()
        beat = control.HeartbeatRequest.model_validate_json(raw or b"{}")
    except GatewayError as error:
        return error_response(error)
    except ValueError as error:
        return error_response(InvalidRequest(f"invalid heartbeat body: {error}"))
    gateway.metrics.heartbeats.inc()
    key = scoped_key(request.scope[TENANT_SCOPE_KEY], conversation_id)
    try:
        conversation = await gateway.store.lookup(key)
    except StateUnavailable as error:
        return error_response(error)
    if conversation is None:
        answer = control.HeartbeatResponse(conversation_id=conversation_id, known=False)
    else:
        remaining = 0.0
        holder = gateway.decode.get(conversation.holder_url)
        lease = conversation.holder_request_id
        # What the holder grants, not what the gateway would like: a client that beats at
        # half of a lease the decode cut short would find it lapsed.
        # A heartbeat renews by the heartbeat lease: the client beats again before it ends,
        # and a client that stops beating frees the KV that much after its last beat.
        asked = config.lease_for(heartbeats=True)
        granted = holder.lease_s(asked) if holder is not None else asked
        if holder is not None and holder.control_url is not None and lease:
            # The lease lives on the holder decode: renew it there.
            expires_in_s = await gateway.runner.context.leases.renew(
                holder.control_url, lease, asked, beat.pause_kind, beat.paused_ms
            )
            if expires_in_s is None:
                gateway.metrics.lease_renewals_by["gone"].inc()
            else:
                gateway.metrics.lease_renewals_by["renewed"].inc()
            try:
                remaining = await gateway.store.renewed(key, lease, expires_in_s)
            except StateUnavailable as error:
                return error_response(error)
        answer = control.HeartbeatResponse(
            conversation_id=conversation_id,
            known=True,
            lease_remaining_s=round(remaining, 3),
            next_heartbeat_s=(min(granted, remaining) if remaining > 0 else granted) / 2,
        )
    return Response(answer.model_dump_json(), media_type="application/json")


async def release(request: Request) -> Response:
    """A client ends a conversation: its entry forgotten, its KV freed on the holder decode."""
    gateway = _gateway(request)
    conversation_id = request.path_params["conversation_id"]
    try:
        check_conversation_id(conversation_id)
    except GatewayError as error:
        return error_response(error)
    try:
        conversation = await gateway.store.remove(
            scoped_key(request.scope[TENANT_SCOPE_KEY], conversation_id)
        )
    except StateUnavailable as error:
        return error_response(error)
    released = conversation is not None
    if conversation is not None:
        gateway.metrics.releases.inc()
        holder = gateway.decode.get(conversation.holder_url)
        key = conversation.holder_request_id
        if holder is not None and holder.control_url is not None and key:
            # Free the blocks on the holder now, not when a lease would lapse.
            await gateway.runner.context.leases.release(holder.control_url, key)
    answer = control.ReleaseResponse(conversation_id=conversation_id, released=released)
    return Response(answer.model_dump_json(), media_type="application/json")


async def stored_response(request: Request) -> Response:
    """``GET``/``DELETE /v1/responses/{id}``: a stored response of the caller's tenant."""
    gateway = _gateway(request)
    response_id = request.path_params["response_id"]
    tenant = request.scope[TENANT_SCOPE_KEY]
    try:
        if request.method == "DELETE":
            if await gateway.responses.delete(tenant, response_id):
                return JSONResponse(deleted(response_id))
            return error_response(not_found(response_id))
        found = await gateway.responses.get(tenant, response_id)
    except GatewayError as error:
        return error_response(error)
    if found is None:
        return error_response(not_found(response_id))
    return JSONResponse(found.response)


async def engine_route(request: Request) -> Response:
    """vLLM's own utility routes (``/version``, ``/tokenize``, ``/detokenize``), answered by
    a prefill engine: the same model, tokenizer and chat template as every engine."""
    gateway = _gateway(request)
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
    return error_response(NoHealthyEngine(f"no engine answered {request.url.path}"))


async def _scrape_decode_leases(gateway: Gateway) -> None:
    """Each decode connector's lease counts, as metrics of the gateway (they are the truth)."""
    metrics = gateway.metrics
    for instance in gateway.decode.instances:
        if instance.control_url is None:
            continue
        stats = await gateway.runner.context.leases.stats(instance.control_url)
        if stats is None:
            continue
        metrics.decode_leases.labels(instance.url).set(stats.get("leases", 0))
        metrics.decode_lease_blocks.labels(instance.url).set(stats.get("blocks_held", 0))
        for event in ("retained", "not_retained", "renewed", "claimed"):
            metrics.decode_lease_events.labels(instance.url, event).set(stats.get(event, 0))
        for reason, count in (stats.get("ended") or {}).items():
            metrics.decode_lease_events.labels(instance.url, f"ended_{reason}").set(count)
