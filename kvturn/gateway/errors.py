"""Typed gateway errors and the one place that turns them into OpenAI-shaped error bodies."""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error type."""

    status = 500
    type = "server_error"
    code: str | None = None
    #: Seconds the client should wait before it retries (a ``Retry-After`` header), if any.
    retry_after_s: int | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """The reply's headers besides its content type: ``Retry-After`` where one is set."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ServerBusy(GatewayError):
    """The gateway turned a request away to protect itself; retrying shortly will work."""

    status = 503
    type = "server_error"
    code = "server_busy"


#: What a 429 asks the client to wait before it retries, seconds. What a caller holds past
#: its share (bodies being read, requests in flight) is let go as its turns end, mostly within
#: seconds. The openai SDK for Python waits what ``Retry-After`` says (up to 2 minutes)
#: instead of its own backoff (0.5 s, doubling, for its 2 retries by default).
RETRY_AFTER_S = 1


class TooManyRequests(GatewayError):
    """One caller holds more of the gateway than its share; retrying shortly will work."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"
    retry_after_s = RETRY_AFTER_S


class NoHealthyEngine(GatewayError):
    status = 503
    type = "server_error"
    code = "no_healthy_engine"


class UpstreamError(GatewayError):
    """An engine failed in a way that retrying elsewhere cannot fix."""

    status = 502
    type = "server_error"
    code = "upstream_error"


class StateUnavailable(GatewayError):
    """The shared state store (:mod:`.state`) could not be reached; retrying shortly may work."""

    status = 503
    type = "server_error"
    code = "state_unavailable"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` exactly as the OpenAI API shapes it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
