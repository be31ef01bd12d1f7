"""What the state's keys are made of: a digest of a tenant and a client's name (a conversation
id, a response id), never the name itself. Client names may hold any character
(:func:`kvturn.headers.conversation_id_problem`); a digest is fixed-length hex, so none reaches
into another tenant's, another kind's or another store's keys."""

from __future__ import annotations

import hashlib


def tenant_digest(kind: str, tenant: str, name: str) -> str:
    """32 hex digits that name ``name`` of ``tenant`` among things of ``kind``: distinct
    kinds, tenants or names never share one (each part is length-prefixed, so no split of one
    string into two collides with another)."""
    digest = hashlib.sha256(b"kvturn-key\0")
    for part in (kind, tenant, name):
        encoded = part.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "big") + encoded)
    return digest.hexdigest()[:32]
