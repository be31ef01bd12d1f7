"""``kvturn serve --config FILE``: a deployment described in one TOML file.

The file names the pools (each engine's URL, and each decode's kvturn control URL), where the
gateway listens, its API keys and any gateway setting by the name ``kvturn serve --help`` and
``GatewayConfig`` use::

    host = "0.0.0.0"                      # where the gateway listens
    port = 8000

    [gateway]                             # any gateway setting, by name
    lease_s = 60
    state = "redis://10.0.0.9:6379/0"

    [auth]
    api_keys_file = "/etc/kvturn/api-keys"   # `key tenant` per line
    operator_keys_file = "/etc/kvturn/operator-keys"   # one key a line: /kvturn/status

    [[prefill]]
    url = "http://10.0.0.1:8000"

    [[decode]]
    url = "http://10.0.0.2:8000"
    control_url = "http://10.0.0.2:8300"  # the connector's kvturn_control_port

Engine and control URLs are ``http://`` (the gateway's engine client speaks plain HTTP; an
``https://`` URL is refused here, at start). A prefill needs ``control_url`` only with
``[gateway] transfer = "push"``. A decode listed without ``control_url`` has none, unless
``[gateway] decode_control_port`` is set: then its control server is that port of the
decode's own host (``kvturn engine``'s convention, default 8300), and each engine is listed
once, by its URL alone.

Precedence, lowest first: the defaults, the file, ``KVTURN_*`` variables, flags. Secrets
(the control secret, the engines' API key) stay in the environment, never in the file. An
unknown key is an error that names it, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvturn.gateway.config import EngineEndpoint, GatewayConfig, check_engine_url

#: Gateway settings the file may not carry (pools have their own tables; secrets and keys stay
#: out of files anyone might commit).
_NOT_IN_FILE = frozenset(
    {
        "prefill",
        "decode",
        "control_secret",
        "api_keys",
        "operator_keys",
        "engine_api_key",
        "tracer_provider",
    }
)
SETTINGS = frozenset(f.name for f in fields(GatewayConfig)) - _NOT_IN_FILE
#: Each setting's type, as its default has it (``state``'s default is None: a string).
_KINDS: dict[str, type] = {
    f.name: str if f.default is None else type(f.default)
    for f in fields(GatewayConfig)
    if f.name in SETTINGS
}


class _Engine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    control_url: str | None = None

    @field_validator("url", "control_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None:
            check_engine_url(value)
        return value.rstrip("/") if value else value


class _Auth(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_keys_file: str | None = None
    operator_keys_file: str | None = None


class DeploymentFile(BaseModel):
    """What a deployment file holds."""

    model_config = ConfigDict(extra="forbid")
    host: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    allow_open: bool | None = None
    gateway: dict[str, Any] = Field(default_factory=dict)
    auth: _Auth = Field(default_factory=_Auth)
    prefill: list[_Engine] = Field(default_factory=list)
    decode: list[_Engine] = Field(default_factory=list)

    @field_validator("gateway")
    @classmethod
    def _known_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - SETTINGS)
        if unknown:
            raise ValueError(
                f"unknown gateway setting(s) {', '.join(unknown)}; known: "
                + ", ".join(sorted(SETTINGS))
            )
        for name, given in value.items():
            want = _KINDS[name]
            ok = isinstance(given, want) and not (want is not bool and isinstance(given, bool))
            if want is float and isinstance(given, int) and not isinstance(given, bool):
                ok = True
            if not ok:
                raise ValueError(f"{name} must be a {want.__name__}, not {given!r}")
        return value

    def endpoints(self) -> dict[str, tuple[EngineEndpoint, ...]]:
        """The pools the file names (only those it names)."""
        pools: dict[str, tuple[EngineEndpoint, ...]] = {}
        if self.prefill:
            pools["prefill"] = tuple(EngineEndpoint(e.url, e.control_url) for e in self.prefill)
        if self.decode:
            pools["decode"] = tuple(EngineEndpoint(e.url, e.control_url) for e in self.decode)
        return pools


def load_deployment(path: str | Path) -> DeploymentFile:
    """Read and check a deployment file; errors name the file and the offending key."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise SystemExit(f"kvturn: cannot read {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise SystemExit(f"kvturn: {path} is not valid TOML: {error}") from None
    try:
        return DeploymentFile.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise SystemExit(f"kvturn: {path}: {problems}") from None
