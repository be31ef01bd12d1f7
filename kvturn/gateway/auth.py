"""Who is calling: API keys, each naming a tenant, as the openai SDK sends them; and the
operators' keys.

Two scopes. The callers' routes are the paths vLLM's own ``--api-key`` guards
(:data:`CALLER_PREFIXES`: ``/v1/...``, the turns, models, stored responses and a
conversation's heartbeat and release): ``Authorization: Bearer <key>``, the key naming the
caller's tenant. Keys come from a file (one ``key tenant`` pair per line; ``#`` starts a
comment) or ``KVTURN_API_KEYS`` (``key=tenant,key=tenant``). With no keys the gateway runs
open: every caller is the one tenant ``""``, as before keys existed. vLLM's other routes
(``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``, ``/version``) are open, as on the
engines. The operators' routes (``/kvturn/status``, and ``/metrics`` when asked) take an
operator key (:class:`OperatorKeys`: ``KVTURN_OPERATOR_KEYS`` or a file, one key a line), or,
while no operator key is set, any caller's key.

Keys are held only as SHA-256 digests and looked up by digest: the lookup's timing says
nothing about how much of a guessed key was right.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvturn.gateway.errors import GatewayError
from kvturn.gateway.state.keys import tenant_digest

#: The environment variable with inline keys (``key=tenant,key=tenant``).
API_KEYS_ENV = "KVTURN_API_KEYS"
#: The environment variable with inline operator keys (``key,key``).
OPERATOR_KEYS_ENV = "KVTURN_OPERATOR_KEYS"
#: The paths a caller's key guards: exactly those vLLM's ``--api-key`` guards (vLLM 0.32,
#: ``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``: a plain prefix
#: test, so an unknown ``/v1...`` path is a 401 before it is a 404; OPTIONS never guarded).
CALLER_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: Tenant names: safe in store keys, cache salts, logs and metric labels.
_TENANT_RE = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")
#: The tenant of an open gateway (no keys configured).
OPEN_TENANT = ""


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _bearer(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None for another scheme)."""
    scheme, _, key = authorization.partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _missing() -> Unauthorized:
    return Unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")


def _check_length(key: str) -> None:
    if len(key) < 16:
        raise ValueError("API keys must be at least 16 characters long")


class ApiKeys:
    """The keys the gateway accepts, each mapped to its tenant."""

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()):
        self._tenants: dict[bytes, str] = {}
        for key, tenant in pairs:
            _check_length(key)
            if not _TENANT_RE.match(tenant):
                raise ValueError(
                    f"invalid tenant name {tenant!r}: 1-64 of letters, digits, '.', '_' or '-'"
                )
            self._tenants[_digest(key)] = tenant

    @property
    def open(self) -> bool:
        """No keys: every caller is let in, as the one tenant ``""``."""
        return not self._tenants

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self._tenants.values())

    def tenant(self, authorization: str | None) -> str:
        """The caller's tenant from its ``Authorization`` header; :class:`Unauthorized` if the
        gateway has keys and this is none of them."""
        if self.open:
            return OPEN_TENANT
        if authorization is None:
            raise _missing()
        key = _bearer(authorization)
        tenant = self._tenants.get(_digest(key)) if key is not None else None
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.")
        return tenant

    @classmethod
    def parse(cls, text: str) -> ApiKeys:
        """``key tenant`` per line (the keys file), or ``key=tenant`` separated by commas."""
        pairs = []
        for raw in re.split(r"[\n,]", text):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key, _, tenant = line.replace("=", " ", 1).partition(" ")
            if not tenant.strip():
                raise ValueError("each API key needs a tenant: 'key tenant' or 'key=tenant'")
            pairs.append((key.strip(), tenant.strip()))
        return cls(pairs)

    @classmethod
    def load(cls, path: str | None, env: Mapping[str, str]) -> ApiKeys:
        """From the keys file at ``path`` and the ``KVTURN_API_KEYS`` variable, together."""
        text = Path(path).read_text() if path else ""
        return cls.parse(text + "\n" + env.get(API_KEYS_ENV, ""))


class OperatorKeys:
    """The keys of the operators' routes (``/kvturn/status``; ``/metrics`` when guarded): no
    tenant, a scope of their own. None set: those routes take any caller's key (open when the
    gateway has no keys at all)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._digests: set[bytes] = set()
        for key in keys:
            _check_length(key)
            self._digests.add(_digest(key))

    @property
    def configured(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        """:class:`Unauthorized` unless ``authorization`` carries one of these keys."""
        if authorization is None:
            raise _missing()
        key = _bearer(authorization)
        if key is None or _digest(key) not in self._digests:
            raise Unauthorized("Incorrect API key provided.")

    @classmethod
    def parse(cls, text: str) -> OperatorKeys:
        """One key per line (the keys file) or separated by commas; ``#`` starts a comment."""
        keys = [raw.split("#", 1)[0].strip() for raw in re.split(r"[\n,]", text)]
        return cls(key for key in keys if key)

    @classmethod
    def load(cls, path: str | None, env: Mapping[str, str]) -> OperatorKeys:
        """From the keys file at ``path`` and the ``KVTURN_OPERATOR_KEYS`` variable, together."""
        text = Path(path).read_text() if path else ""
        return cls.parse(text + "\n" + env.get(OPERATOR_KEYS_ENV, ""))


def scoped_key(tenant: str, conversation_id: str) -> str:
    """A conversation's key in the table and on decode (``kvturn_conversation``): a digest of
    the tenant and the id, so one tenant's ``chat-1`` is never another's, and the client's id,
    which may hold any character (:func:`kvturn.headers.conversation_id_problem`), reaches no
    state key, decode, log line or metric label; only the gateway's echo carries it back."""
    return "c-" + tenant_digest("conversation", tenant, conversation_id)


def tenant_salt(tenant: str, client_salt: object) -> str | None:
    """The ``cache_salt`` the engines get: a tenant's prefix-cache entries match only that
    tenant's requests; a salt the client sent still separates its own requests further."""
    if not tenant:
        return client_salt if isinstance(client_salt, str) else None
    salt = "kvturn-t-" + hashlib.sha256(f"kvturn-tenant:{tenant}".encode()).hexdigest()[:32]
    return f"{salt}:{client_salt}" if isinstance(client_salt, str) and client_salt else salt
