"""The request bodies a server holds (read, not yet served): bounded for all connections
together, and for each caller, so that no caller can take the whole budget from the others
(:class:`~.connection.ServerLimits` sets both; its ``admit`` names a request's caller from
its head, before any of its body is read)."""

from __future__ import annotations

from kvturn.gateway.errors import GatewayError, ServerBusy, TooManyRequests


class BodyBudget:
    """Body bytes held, in all and by caller (``None``: counted in all only)."""

    def __init__(self, total_bytes: int, caller_bytes: int):
        self.total_bytes = total_bytes
        self.caller_bytes = caller_bytes
        self.held = 0
        self.by_caller: dict[str, int] = {}

    def take(self, caller: str | None, size: int) -> GatewayError | None:
        """Count ``size`` more bytes of a body being read; the error to refuse the request
        with if that goes past a bound (the caller's first: 429; then all: 503). Counted
        either way: the refusal gives them back (:meth:`give_back`)."""
        self.held += size
        if caller is not None:
            held = self.by_caller[caller] = self.by_caller.get(caller, 0) + size
            if held > self.caller_bytes:
                return TooManyRequests(
                    "this API key's requests hold too many request bodies at once; retry shortly"
                )
        if self.held > self.total_bytes:
            return ServerBusy("the gateway is holding too many request bodies; retry shortly")
        return None

    def give_back(self, caller: str | None, size: int) -> None:
        """A body was served, refused or abandoned: its bytes leave the budget."""
        self.held -= size
        if caller is not None and size:
            held = self.by_caller[caller] - size
            if held:
                self.by_caller[caller] = held
            else:
                del self.by_caller[caller]
