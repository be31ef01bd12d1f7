"""Any id string (issue 40): the rule (:func:`kvturn.headers.conversation_id_problem`), how an id
travels (headers, body, control paths, the gateway's echo), the keys the gateway makes of it,
and every form served with reuse by a gateway on the fake engine, through the kvturn client too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from kvturn import control
from kvturn import headers as h
from kvturn.client import OpenAI
from kvturn.gateway.auth import scoped_key
from kvturn.gateway.config import GatewayConfig, endpoints
from kvturn.gateway.server import GatewayThread
from kvturn.gateway.state.redis_client import RedisState
from kvturn.gateway.state.response_store import RedisResponseStore
from kvturn.gateway.state.table import Held
from kvturn.gateway.state.table_redis import RedisConversations
from tests.conversation_ids import ID_FORMS, WAYS, named
from tests.gateway_fixtures import metric, running_fake_engine, running_gateway, running_redis

#: Long enough that a turn's KV is worth reusing (the fake engine counts a token a byte).
MESSAGES = [
    {"role": "user", "content": "Read the repository and list the modules that import the wire."}
]
FORMS = list(ID_FORMS.values())

# -- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", FORMS, ids=list(ID_FORMS))
def test_every_form_is_an_id(value: str) -> None:
    assert h.conversation_id_problem(value) is None
    assert h.is_valid_conversation_id(value)


def test_the_limit_is_1024_bytes_of_utf8() -> None:
    assert h.CONVERSATION_ID_MAX_BYTES == 1024
    for fits in ("x" * 1024, "é" * 512, "☕" * 341 + "x", "😀" * 256):
        assert len(fits.encode()) <= 1024 and h.is_valid_conversation_id(fits)
    for over in ("x" * 1025, "é" * 513, "😀" * 256 + "x"):
        problem = h.conversation_id_problem(over)
        assert problem is not None and "1024 bytes" in problem


@pytest.mark.parametrize(
    "value",
    [
        "",
        *(f"a{chr(c)}b" for c in range(0x20)),  # C0, tab and newlines among them
        "a\x7fb",  # DEL
        "a\x85b",  # C1 (NEL: a line break to Python)
        "a\x9fb",
        "a\u2028b",  # line and paragraph separators
        "a\u2029b",
        "a\ud800b",  # an unpaired surrogate: not UTF-8
    ],
)
def test_what_cannot_travel_is_refused(value: str) -> None:
    assert h.conversation_id_problem(value) is not None
    assert not h.is_valid_conversation_id(value)


@pytest.mark.parametrize("value", [*FORMS, "c1", "a:b", "x" * 1024, "utf-8''lower", "ü"])
def test_an_id_travels_in_a_header_as_itself_or_marked(value: str) -> None:
    header = h.conversation_id_header(value)
    assert header.isascii() and header.isprintable() and header == header.strip()
    assert h.conversation_id_from_header(header) == value
    plain = value.isascii() and value == value.strip() and not value.upper().startswith("UTF-8''")
    assert (header == value) is plain  # printable ASCII ids are sent (and echoed) unchanged
    if not plain:
        assert header.startswith(h.ENCODED_ID_PREFIX)


def test_the_marker_is_read_in_any_case_and_refused_when_malformed() -> None:
    assert h.conversation_id_from_header("utf-8''caf%C3%A9") == "café"
    assert h.conversation_id_from_header("UTF-8''%20x%2F") == " x/"
    for bad in ("UTF-8''%FF", "UTF-8''a b", "UTF-8''%zz", "UTF-8''caf\u00e9"):
        with pytest.raises(ValueError):
            h.conversation_id_from_header(bad)


@pytest.mark.parametrize("value", [*FORMS, "c1", ".", "a:b"])
def test_a_control_path_holds_the_id_as_one_segment(value: str) -> None:
    path = control.heartbeat_path(value)
    prefix = control.CONVERSATIONS_PATH + "/"
    assert path.startswith(prefix) and path.endswith("/heartbeat")
    segment = path[len(prefix) : -len("/heartbeat")]
    assert segment.isascii() and not set(segment) & set("/?# ") and segment not in (".", "..")
    assert unquote(segment) == value
    assert control.release_path(value) == prefix + segment
    assert control.path_segment("a:b") == "a:b"  # ids valid before keep their paths


def test_keys_are_digests_of_tenant_and_id() -> None:
    key = scoped_key("", "café ☕ 会话")
    assert key.startswith("c-") and len(key) == 34 and key[2:].isalnum() and key.isascii()
    assert key == scoped_key("", "café ☕ 会话")
    # No split of one string between tenant and id names another's conversation.
    assert scoped_key("a", "b/c") != scoped_key("a/b", "c")
    assert scoped_key("", "t/x") != scoped_key("t", "x")
    assert scoped_key("alpha", "x") != scoped_key("beta", "x")


# -- the gateway on the fake engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with running_fake_engine() as url:
        yield url


@pytest.fixture
def gateway(fake_url: str) -> Iterator[str]:
    # The same messages again reuse by a pull (the holder would continue them otherwise).
    config = GatewayConfig(
        prefill=endpoints([fake_url]), decode=endpoints([fake_url], [fake_url]), decode_local=False
    )
    with running_gateway(config) as running:
        yield running.url


def _chat(url: str, headers: Any = None, **body: Any) -> httpx.Response:
    payload = {"model": "fake", "messages": MESSAGES, **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=headers)


@pytest.mark.parametrize("way", WAYS)
def test_every_form_is_served_and_its_second_turn_reuses(gateway: str, way: str) -> None:
    for name, conversation_id in ID_FORMS.items():
        headers, body = named(way, conversation_id)
        first = _chat(gateway, headers, **body)
        assert first.status_code == 200, (name, first.text)
        assert first.headers["x-kvturn-plan"] == "recompute", name
        echoed = first.headers["x-conversation-id"]
        assert h.conversation_id_from_header(echoed) == conversation_id, name
        assert echoed == h.conversation_id_header(conversation_id), name
        second = _chat(gateway, headers, **body)
        assert second.status_code == 200, (name, second.text)
        assert second.headers["x-kvturn-plan"] == "pull-reuse", name


def test_printable_ascii_ids_are_echoed_unchanged(gateway: str) -> None:
    for conversation_id in ("user@example.com", "team a / chat 7", "conv#42?x=1", "a:b"):
        reply = _chat(gateway, {h.CONVERSATION_ID: conversation_id})
        assert reply.headers["x-conversation-id"] == conversation_id


def test_a_raw_utf8_header_names_the_same_conversation(gateway: str) -> None:
    """Some clients (curl) send a header's UTF-8 as it is: the gateway reads it as UTF-8, the
    same conversation as the marked form, and echoes the marked form (ASCII on the wire)."""
    conversation_id = "café ☕ 会话"
    raw = _chat(gateway, [(h.CONVERSATION_ID.encode(), conversation_id.encode())])
    assert raw.status_code == 200 and raw.headers["x-kvturn-plan"] == "recompute"
    assert raw.headers["x-conversation-id"] == h.conversation_id_header(conversation_id)
    marked = _chat(gateway, {h.CONVERSATION_ID: h.conversation_id_header(conversation_id)})
    assert marked.headers["x-kvturn-plan"] == "pull-reuse"
    body = _chat(gateway, prompt_cache_key=conversation_id)
    assert body.headers["x-kvturn-plan"] == "pull-reuse"


def test_an_empty_id_is_no_id(gateway: str) -> None:
    for headers, body in (
        ({h.CONVERSATION_ID: ""}, {}),
        ({h.SESSION_ID: ""}, {}),
        ({}, {"prompt_cache_key": ""}),
        ({}, {"conversation_id": ""}),
    ):
        reply = _chat(gateway, headers, **body)
        assert reply.status_code == 200, reply.text
        # No id: a chat without one is an implicit conversation (found by its messages).
        assert reply.headers["x-conversation-id"].startswith("implicit-")
    # An empty X-Conversation-Id gives way to X-Session-ID, as an absent one does.
    reply = _chat(gateway, {h.CONVERSATION_ID: "", h.SESSION_ID: "the session"})
    assert reply.headers["x-conversation-id"] == "the session"


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({}, {"prompt_cache_key": "a\nb"}),
        ({}, {"prompt_cache_key": "x" * 1025}),
        ({}, {"conversation_id": "é" * 513}),
        ({}, {"prompt_cache_key": "line\u2028separator"}),
        ({}, {"prompt_cache_key": 42}),
        ({h.CONVERSATION_ID: "x" * 1025}, {}),
        ({h.SESSION_ID: "UTF-8''%FF"}, {}),  # not UTF-8
        ({h.CONVERSATION_ID: "UTF-8''a%0Ab"}, {}),  # a control character, encoded
        ({h.CONVERSATION_ID: "UTF-8''not encoded"}, {}),
    ],
)
def test_ids_that_cannot_travel_are_refused(
    gateway: str, headers: dict[str, str], body: dict[str, Any]
) -> None:
    response = _chat(gateway, headers, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "conversation_id" and error["type"] == "invalid_request_error"


def test_control_routes_decode_any_id(gateway: str) -> None:
    for conversation_id in FORMS:
        _chat(gateway, prompt_cache_key=conversation_id)
        beat = httpx.post(gateway + "/v1" + control.heartbeat_path(conversation_id), json={})
        answer = control.HeartbeatResponse.model_validate_json(beat.content)
        assert answer.known and answer.conversation_id == conversation_id
    # ``a/heartbeat`` and ``a`` are two conversations; releasing one leaves the other.
    _chat(gateway, prompt_cache_key="a")
    assert FORMS.index("a/heartbeat") >= 0
    for conversation_id in (*FORMS, "a"):
        gone = httpx.delete(gateway + "/v1" + control.release_path(conversation_id))
        answer = control.ReleaseResponse.model_validate_json(gone.content)
        assert answer.released and answer.conversation_id == conversation_id, conversation_id
    empty = httpx.post(gateway + "/v1/kvturn/conversations//heartbeat", json={})
    assert empty.status_code == 400


# -- through the kvturn client --------------------------------------------------------------

LEASE_S = 0.4


@pytest.fixture(scope="module")
def short_lease(fake_url: str) -> Iterator[GatewayThread]:
    config = GatewayConfig(
        prefill=endpoints([fake_url]),
        decode=endpoints([fake_url], [fake_url]),
        lease_s=LEASE_S,
        expiry_margin_s=0.05,
        decode_local=False,  # the same messages again reuse by a pull
    )
    with running_gateway(config) as running:
        yield running


def test_the_client_beats_and_releases_any_id(short_lease: GatewayThread) -> None:
    """Each form as ``client.conversation(id)``: its turns carry it (marked where it must be),
    its heartbeats keep the lease through a pause of more than two leases, its second turn
    reuses, and ``release_conversation`` frees it on the gateway."""
    url, store = short_lease.url, short_lease.app.state.gateway.store
    beats = metric(url + "/metrics", "kvturn_heartbeats_total")
    releases = metric(url + "/metrics", "kvturn_releases_total")
    client = OpenAI(base_url=url + "/v1", api_key="-")
    try:
        for conversation_id in FORMS:
            with client.conversation(conversation_id, release=False):
                client.chat.completions.create(model="fake", messages=MESSAGES)
        time.sleep(1.0)  # every conversation pauses: only heartbeats keep their leases
        assert metric(url + "/metrics", "kvturn_heartbeats_total") - beats >= len(FORMS)
        now = store.clock()
        for conversation_id in FORMS:
            entry = store.peek(scoped_key("", conversation_id))
            assert entry is not None and entry.lease_expires_at > now, conversation_id
        for conversation_id in FORMS:
            with client.conversation(conversation_id, release=False):
                raw = client.chat.completions.with_raw_response.create(
                    model="fake", messages=MESSAGES
                )
            assert raw.headers["x-kvturn-plan"] == "pull-reuse", conversation_id
        for conversation_id in FORMS:
            client.release_conversation(conversation_id)
            assert store.peek(scoped_key("", conversation_id)) is None, conversation_id
        assert metric(url + "/metrics", "kvturn_releases_total") - releases == len(FORMS)
    finally:
        client.close()


# -- Redis: the table's keys and the Responses store's never meet ---------------------------


async def test_a_conversation_and_a_responses_conversation_never_share_a_redis_key() -> None:
    """Before issue 40 the table stored ``{prefix}conv:{key}`` (the key being the id itself on
    an open gateway) and the Responses store ``{prefix}conv:{tenant-hex}:{id}`` (tenant ``""``:
    ``conv::x``): chat conversation ``:x`` and Responses conversation ``x`` were one Redis
    key. Now each store has its own namespace, and both name things by digest."""
    with running_redis() as server:
        redis = RedisState(server.url, timeout_s=2.0, prefix="t40:")
        try:
            table = RedisConversations(redis, idle_s=600)
            responses = RedisResponseStore(redis, ttl_s=600)
            key = scoped_key("", ":x")
            taken = await table.take(key, ":x", "turn-1")
            held = Held("http://decode-1", "req-1", 100, 60.0)
            recorded = await table.record(key, taken.conversation.epoch, taken.turn, held)
            assert recorded.kept
            history = [{"role": "user", "content": "from the Responses API"}]
            await responses.put_conversation("", "x", history)
            # Both are there, each whole, whatever order they are read or written in.
            entry = await table.lookup(key)
            assert entry is not None and entry.holder_request_id == "req-1"
            assert await responses.conversation("", "x") == history
            await responses.put_conversation("", ":x", history)
            entry = await table.lookup(key)
            assert entry is not None and entry.holder_request_id == "req-1"
            keys = {k.decode() for k in await redis.client.keys("t40:*")}
            table_keys = {k for k in keys if k.startswith("t40:conv:")}
            response_keys = {k for k in keys if k.startswith("t40:responses:")}
            assert table_keys == {"t40:conv:" + key}
            assert len(response_keys) == 2 and not table_keys & response_keys
            assert not any(":x" in k.removeprefix("t40:") for k in keys)  # no id in any key
        finally:
            await redis.close()
