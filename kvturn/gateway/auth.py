"""Who is calling: API keys, each naming a tenant, as the openai SDK sends them.

``Authorization: Bearer <key>`` on every route but ``/health``. Keys come from a file (one
``key tenant`` pair per line; ``#`` starts a comment) or ``KVTURN_API_KEYS``
(``key=tenant,key=tenant``). With no keys the gateway runs open: every caller is the one
tenant ``""``, as before keys existed.

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


class ApiKeys:
    """The keys the gateway accepts, each mapped to its tenant."""

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()):
        self._tenants: dict[bytes, str] = {}
        for key, tenant in pairs:
            if len(key) < 16:
                raise ValueError("API keys must be at least 16 characters long")
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
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        scheme, _, key = authorization.partition(" ")
        tenant = self._tenants.get(_digest(key.strip())) if scheme.lower() == "bearer" else None
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
