"""The gateway's client to the engines: JSON in and out over :mod:`.client`, the engines' API
key on every request, transport failures as :class:`UpstreamUnavailable`."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kvturn.gateway.http.client import HttpClient, HttpError, Response, StreamResponse
from kvturn.gateway.http.pool import LocalResourceError
from kvturn.wire import HEALTH_PATH as CONTROL_HEALTH_PATH

logger = logging.getLogger("kvturn.gateway")

__all__ = ["StreamResponse", "Upstream", "UpstreamResponse", "UpstreamUnavailable", "next_chunk"]

#: A complete engine response (``status``, lower-case ``headers``, ``body``).
UpstreamResponse = Response

_JSON = {"content-type": "application/json"}


class UpstreamUnavailable(Exception):
    """The engine could not be reached, or broke the connection; ``local``: for want of this
    process's own resources (out of file descriptors...), which says nothing of the engine:
    it must not be marked unhealthy for it (issue #39, case 2)."""

    def __init__(self, message: str, *, local: bool = False):
        super().__init__(message)
        self.local = local


_logged_local_at = 0.0


def _unavailable(url: str, error: HttpError) -> UpstreamUnavailable:
    global _logged_local_at
    local = isinstance(error, LocalResourceError)
    if local and time.monotonic() - _logged_local_at > 10:
        _logged_local_at = time.monotonic()
        logger.error("the gateway is out of its own resources (%s): requests fail; the "
                     "engines are not at fault (logged at most every 10 s)", error)  # fmt: skip
    return UpstreamUnavailable(f"{url}: {error}", local=local)


class Upstream:
    """One connection-pooling client for every engine."""

    def __init__(
        self,
        connect_timeout_s: float,
        request_timeout_s: float,
        api_key: str | None = None,
        max_stream_s: float = 0.0,
    ):
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._max_stream_s = max_stream_s
        self._client: HttpClient | None = None
        #: The engines' API key (vLLM's ``--api-key``), sent on every engine request.
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._json = {**_JSON, **self._auth}

    async def start(self) -> None:
        self._client = HttpClient(
            self._connect_timeout_s, self._request_timeout_s, max_stream_s=self._max_stream_s
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> HttpClient:
        assert self._client is not None, "Upstream.start() was not awaited"
        return self._client

    async def post_json(
        self,
        url: str,
        body: Any,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        try:
            return await self.client.request(
                "POST", url, orjson.dumps(body), self._with(headers), timeout_s=timeout_s
            )
        except HttpError as error:
            raise _unavailable(url, error) from error

    async def forward(
        self, method: str, url: str, body: bytes, content_type: str | None
    ) -> Response:
        """A request passed on as it came (the engine routes the gateway only relays)."""
        headers = {**self._auth, "content-type": content_type} if content_type else self._auth
        try:
            return await self.client.request(method, url, body or None, headers or None)
        except HttpError as error:
            raise _unavailable(url, error) from error

    async def get(self, url: str, timeout_s: float | None = None) -> Response:
        try:
            return await self.client.request(
                "GET", url, headers=self._auth or None, timeout_s=timeout_s
            )
        except HttpError as error:
            raise _unavailable(url, error) from error

    async def is_healthy(self, url: str) -> bool | None:
        """Whether the engine answers its health route (``None``: not known, this process
        could not ask for want of its own resources)."""
        try:
            return (await self.get(f"{url}/health", timeout_s=2.0)).status == 200
        except UpstreamUnavailable as error:
            return None if error.local else False

    async def is_draining(self, control_url: str) -> bool | None:
        """Whether an engine's kvturn control server says it is draining (it takes no new
        turns: :data:`~kvturn.wire.DRAIN_PATH`); ``None``: not known."""
        try:
            response = await self.get(f"{control_url}{CONTROL_HEALTH_PATH}", timeout_s=2.0)
        except UpstreamUnavailable:
            return None
        if response.status != 200:
            return None
        return bool(response.json().get("draining"))

    async def open_stream(
        self, url: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> StreamResponse:
        """POST and return the response once its headers arrived; the caller must close it."""
        try:
            return await self.client.open("POST", url, orjson.dumps(body), self._with(headers))
        except HttpError as error:
            raise _unavailable(url, error) from error

    def _with(self, extra: Mapping[str, str] | None) -> Mapping[str, str]:
        """JSON content type, the engines' key, and ``extra``."""
        return {**self._json, **extra} if extra else self._json


async def next_chunk(stream: StreamResponse) -> bytes | None:
    """The next bytes of a streamed body as they arrived (never re-framed), None at its end."""
    try:
        return await stream.next_chunk()
    except HttpError as error:
        raise UpstreamUnavailable(str(error)) from error
