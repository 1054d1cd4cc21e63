"""Bearer API keys: `cq-` + 43 URL-safe characters (256 random bits). Only the SHA-256 of a token is
stored; a token is shown once, when it is created. A high-entropy token needs no slow password hash:
guessing one is as hard as guessing the key itself, and lookups stay one indexed equality."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass

from sqlalchemy import select, update

from canvasq.core.tables import ApiKey, utcnow

TOKEN_PREFIX = "cq-"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Principal:
    key_id: str
    project: str


def create_key(store, project: str, name: str | None = None) -> tuple[str, str]:
    """(key id, token). The token is returned here and never again."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    key_id = "key_" + uuid.uuid4().hex[:16]
    with store.Session.begin() as s:
        s.add(
            ApiKey(
                id=key_id,
                project=project,
                name=name,
                prefix=token[:10],
                key_hash=hash_token(token),
                created_at=utcnow(),
            )
        )
    return key_id, token


def revoke_key(store, key_id: str) -> bool:
    with store.Session.begin() as s:
        res = s.execute(
            update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow())
        )
        return res.rowcount == 1


def list_keys(store, include_revoked: bool = False) -> list[ApiKey]:
    with store.Session() as s:
        q = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if not include_revoked:
            q = q.where(ApiKey.revoked_at.is_(None))
        return list(s.scalars(q))


def authenticate(store, token: str | None) -> Principal | None:
    """The live key behind `token`, or None (unknown, revoked, or no token)."""
    if not token:
        return None
    with store.Session() as s:
        row = s.execute(
            select(ApiKey.id, ApiKey.project).where(
                ApiKey.key_hash == hash_token(token), ApiKey.revoked_at.is_(None)
            )
        ).first()
    return Principal(row[0], row[1]) if row else None
