"""The kvturn options a client is constructed with; ``copy()``/``with_options()`` keep them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_LEASE_SECONDS", "DEFAULT_MAX_PAUSE_SECONDS", "KvturnSettings"]

#: Lease length assumed until the gateway states one (upstream's P-side ``kv_lease_duration``).
DEFAULT_LEASE_SECONDS = 30.0
#: After this long paused the agent is probably gone for good: stop renewing its KV.
DEFAULT_MAX_PAUSE_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class KvturnSettings:
    """How a kvturn client tracks pauses, beats and releases.

    Attributes:
        default_lease_seconds: lease length used while the gateway has not sent
            ``X-Kvturn-Lease-Seconds``.
        max_pause_seconds: heartbeats stop once a pause has lasted this long.
        heartbeats: renew leases during pauses at all.
        release_on_exit: default for ``conversation(release=...)``.
        control_timeout_seconds: timeout of one heartbeat or release call; these must never
            hold the agent up for long.
        min_heartbeat_interval_seconds: floor on the beat period, whatever the gateway says,
            so a tiny lease cannot turn the beat loop into a busy loop.
    """

    default_lease_seconds: float = DEFAULT_LEASE_SECONDS
    max_pause_seconds: float = DEFAULT_MAX_PAUSE_SECONDS
    heartbeats: bool = True
    release_on_exit: bool = True
    control_timeout_seconds: float = 5.0
    min_heartbeat_interval_seconds: float = 0.05

    def __post_init__(self) -> None:
        if self.default_lease_seconds <= 0:
            raise ValueError("default_lease_seconds must be positive")
        if self.max_pause_seconds <= 0:
            raise ValueError("max_pause_seconds must be positive")
        if self.control_timeout_seconds <= 0:
            raise ValueError("control_timeout_seconds must be positive")
