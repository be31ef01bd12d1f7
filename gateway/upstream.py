"""The gateway's HTTP client to the engines (aiohttp: measured faster than httpx here)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    body: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        return orjson.loads(self.body)


class UpstreamUnavailable(Exception):
    """The engine could not be reached, or broke the connection."""


class Upstream:
    """One pooled aiohttp session for every engine."""

    def __init__(self, connect_timeout_s: float, request_timeout_s: float):
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(
            total=self._request_timeout_s, sock_connect=self._connect_timeout_s
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Upstream.start() was not awaited"
        return self._session

    async def post_json(
        self, url: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> UpstreamResponse:
        try:
            async with self.session.post(
                url, data=orjson.dumps(body), headers=_json_headers(headers)
            ) as response:
                return UpstreamResponse(response.status, await response.read(), response.headers)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UpstreamUnavailable(f"{url}: {error!r}") from error

    async def get(self, url: str, timeout_s: float | None = None) -> UpstreamResponse:
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
            async with self.session.get(url, timeout=timeout) as response:
                return UpstreamResponse(response.status, await response.read(), response.headers)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UpstreamUnavailable(f"{url}: {error!r}") from error

    async def is_healthy(self, url: str) -> bool:
        try:
            return (await self.get(f"{url}/health", timeout_s=2.0)).status == 200
        except UpstreamUnavailable:
            return False

    async def open_stream(
        self, url: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        """POST and return the response once its headers arrived; the caller must release it."""
        try:
            return await self.session.post(
                url, data=orjson.dumps(body), headers=_json_headers(headers)
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UpstreamUnavailable(f"{url}: {error!r}") from error


async def iter_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Bytes as they arrive: no re-framing, no buffering beyond what the socket delivers."""
    try:
        async for chunk in response.content.iter_any():
            yield chunk
    except (aiohttp.ClientError, TimeoutError) as error:
        raise UpstreamUnavailable(repr(error)) from error
    finally:
        response.release()


def _json_headers(extra: Mapping[str, str] | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if extra:
        headers.update(extra)
    return headers
