"""The API keys `sdq serve` takes requests with: made here, shown once, kept as their
SHA-256 (models/generate/tables.ApiKey), revoked by name."""

import hashlib
import secrets
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sdq.models.generate.tables import ApiKey
from sdq.models.jobs.lifecycle import utcnow
from sdq.producer.errors import NotFound

PREFIX = "sdq_"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, name: str) -> str:
    """A new key named `name`, returned once: only its hash is kept."""
    if not name or len(name) > 64 or not name.isprintable():
        raise ValueError(f"a key's name is 1 to 64 printable characters, got {name!r}")
    key = PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(name=name, digest=digest(key)))
    try:
        session.flush()
    except IntegrityError:
        raise ValueError(
            f"a key named {name!r} exists: revoke it, or choose another name"
        ) from None
    return key


def list_keys(session: Session) -> list[dict[str, Any]]:
    keys = session.scalars(select(ApiKey).order_by(ApiKey.id)).all()
    return [
        {"name": key.name, "created_at": key.created_at, "revoked_at": key.revoked_at}
        for key in keys
    ]


def revoke_key(session: Session, name: str) -> None:
    key = session.scalars(select(ApiKey).where(ApiKey.name == name)).one_or_none()
    if key is None:
        raise NotFound(f"no API key named {name!r} (`sdq serve keys list` lists them)")
    key.revoked_at = key.revoked_at or utcnow()


def key_name(session: Session, key: str) -> str | None:
    """The name of a key that is not revoked, or None."""
    return session.scalars(
        select(ApiKey.name).where(ApiKey.digest == digest(key), ApiKey.revoked_at.is_(None))
    ).one_or_none()
