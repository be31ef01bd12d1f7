"""The gateway's side of decode leases: the kvturn control channel of each decode engine
(and, in push mode, of each prefill engine, for its NIXL identity). Routes and bodies are
:mod:`kvturn.wire`'s.

Every call carries the shared secret (``authorization: Bearer``). A holder that cannot be
reached or answers an error is treated as holding nothing: the turn recomputes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from tenacity import AsyncRetrying, retry_if_result, stop_after_attempt, wait_exponential

from kvturn.gateway.http.client import HttpError
from kvturn.gateway.http.upstream import Upstream
from kvturn.wire import (
    CONTROL_AUTH_HEADER,
    IDENTITY_PATH,
    LEASES_PATH,
    WAKE_PATH,
    LeaseGone,
    LeaseReleased,
    PushState,
    RenewRequest,
    RenewResponse,
    WakeRequest,
    claim_path,
    control_authorization,
    lease_path,
    pushes_path,
    renew_path,
    retained_path,
)

logger = logging.getLogger("kvturn.gateway")

_TIMEOUT_S = 2.0
#: A release that could not reach its decode is tried again (it frees blocks now rather than
#: when the lease lapses): three attempts, 0.2 s then 0.4 s apart.
RELEASE_ATTEMPTS = 3

_Model = TypeVar("_Model", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Claimed:
    """A claimed lease's params (``None`` when there is none) and why there is none."""

    params: dict[str, Any] | None
    reason: str = "claimed"


class LeaseClient:
    """Claim, renew and release leases on decode engines' control servers."""

    def __init__(self, upstream: Upstream, secret: str | None):
        self.upstream = upstream
        self._headers = {CONTROL_AUTH_HEADER: control_authorization(secret)} if secret else {}

    async def published(self, control_url: str, key: str, wait_s: float) -> dict[str, Any] | None:
        """The lease a finished turn left under ``key`` (waiting up to ``wait_s`` for it)."""
        url = control_url + retained_path(key, wait_s)
        answer = await self._call("GET", url, timeout_s=wait_s + _TIMEOUT_S)
        return answer[1] if answer is not None and answer[0] == 200 else None

    async def claim(self, control_url: str, key: str) -> Claimed:
        """Hold the lease for a prefill that is about to read it."""
        answer = await self._call("POST", control_url + claim_path(key))
        if answer is None:
            return Claimed(None, "holder-unreachable")
        status, body = answer
        if status == 200:
            return Claimed(body)
        gone = _parsed(LeaseGone, body)
        return Claimed(None, (gone and gone.reason) or f"http-{status}")

    async def renew(
        self, control_url: str, key: str, lease_s: float, pause_kind: str, paused_ms: int
    ) -> float | None:
        """Extend a live lease; the seconds it now has left, or ``None`` if it is gone."""
        try:
            body = RenewRequest(lease_s=lease_s, pause_kind=pause_kind, paused_ms=paused_ms)
        except ValidationError:  # an infinite lease: the holder would refuse it
            return None
        answer = await self._call("POST", control_url + renew_path(key), body.model_dump())
        if answer is None or answer[0] != 200:
            return None
        renewed = _parsed(RenewResponse, answer[1])
        return renewed.expires_in_s if renewed is not None else 0.0

    async def release(self, control_url: str, key: str, *, claimed: bool = False) -> bool:
        """Free the lease's blocks (``claimed``: this gateway's own claim is over)."""
        url = control_url + lease_path(key, claimed=claimed)
        answer = None
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(RELEASE_ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_result(lambda answer: answer is None),  # unreachable, not "no lease"
            retry_error_callback=lambda state: None,
        ):
            with attempt:
                answer = await self._call("DELETE", url)
            if not attempt.retry_state.outcome.failed:  # type: ignore[union-attr]
                attempt.retry_state.set_result(answer)
        if answer is None or answer[0] != 200:
            return False
        released = _parsed(LeaseReleased, answer[1])
        return released is not None and released.released

    async def wake(self, control_url: str, within_ms: float | None = None) -> None:
        """Tell an idle decode a turn is on its way (it stops pacing its idle steps); and,
        with ``within_ms``, that the request itself arrives that soon (it steps often until
        then)."""
        body = None if within_ms is None else WakeRequest(within_ms=within_ms).model_dump()
        await self._call("POST", control_url + WAKE_PATH, body)

    async def identity(self, control_url: str) -> dict[str, Any] | None:
        """An engine's NIXL identity (:class:`~kvturn.wire.EngineIdentity`'s fields), or
        ``None``."""
        answer = await self._call("GET", control_url + IDENTITY_PATH)
        if answer is None or answer[0] != 200 or not answer[1].get("engine_id"):
            return None
        return answer[1]

    async def push_state(self, control_url: str, key: str, wait_s: float) -> str | None:
        """Push mode, decode: ``arrived``, ``awaiting`` or ``unknown`` for the KV pushed for
        ``key`` (waiting up to ``wait_s`` for it to arrive); ``None`` if decode cannot say."""
        url = control_url + pushes_path(key, wait_s)
        answer = await self._call("GET", url, timeout_s=wait_s + _TIMEOUT_S)
        if answer is None or answer[0] != 200:
            return None
        pushed = _parsed(PushState, answer[1])
        return pushed.state if pushed is not None else "unknown"

    async def stats(self, control_url: str) -> dict[str, Any] | None:
        """A decode's lease counts and engine facts (:class:`~kvturn.wire.LeaseStats`'s JSON)."""
        answer = await self._call("GET", control_url + LEASES_PATH)
        return answer[1] if answer is not None and answer[0] == 200 else None

    async def _call(
        self, method: str, url: str, body: Any = None, timeout_s: float = _TIMEOUT_S
    ) -> tuple[int, dict[str, Any]] | None:
        headers = dict(self._headers)
        payload = None
        if body is not None:
            payload = orjson.dumps(body)
            headers["content-type"] = "application/json"
        try:
            response = await self.upstream.client.request(
                method, url, payload, headers, timeout_s=timeout_s
            )
        except HttpError as error:
            logger.debug("lease call %s %s failed: %s", method, url, error)
            return None
        if response.status == 401:
            logger.error("decode control channel refused the gateway's secret (%s)", url)
        try:
            data = orjson.loads(response.body) if response.body else {}
        except orjson.JSONDecodeError:
            data = {}
        return response.status, data if isinstance(data, dict) else {}


def _parsed(model: type[_Model], body: dict[str, Any]) -> _Model | None:
    """``body`` as ``model``, or ``None`` if it is not one (an engine of another version)."""
    try:
        return model.model_validate(body)
    except ValidationError:
        return None
