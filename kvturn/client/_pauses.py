"""Pauses: how long a conversation sat idle between a reply and the next request.

A pause runs from the end of a reply (a non-streamed return, or a stream exhausted or closed)
to the start of the next request in the same conversation. It is a *tool* pause when the reply
asked for tool calls (or an adapter saw a tool start), otherwise a *user* pause. With parallel
requests the conversation only counts as paused while nothing is in flight.

The pause clock is part of each :class:`~kvturn.client.Conversation`; the client starts its
turns (``BaseKvturnClient._kvturn_begin``) and ``finish_turn`` ends them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvturn.headers import PauseKind

__all__ = ["Pause"]


@dataclass(frozen=True, slots=True)
class Pause:
    """A measured pause: its length and what it was spent on."""

    ms: int
    kind: PauseKind
