"""The farm API's bearer tokens as rows: added, listed, found by id or by the sha256 of the token,
marked used. What a token is, its scopes and how one is checked are the API's
(orchestrator/api/tokens.py).
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from .models import ApiScope, ApiToken

__all__ = ["add_api_token", "api_token_of_digest", "api_tokens", "find_api_token", "mark_api_token_used"]


def add_api_token(session: Session, *, name: str, scope: ApiScope, prefix: str, sha256: str) -> ApiToken:
    """A new token's row: its name, scope, first characters and the sha256 of the token."""
    row = ApiToken(name=name, scope=scope, prefix=prefix, sha256=sha256)
    session.add(row)
    session.flush()
    return row


def api_tokens(session: Session) -> list[ApiToken]:
    """Every token, revoked ones too, in the order they were made."""
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


def find_api_token(session: Session, token_id: int) -> ApiToken | None:
    """The token `token_id`, or None."""
    return session.get(ApiToken, token_id)


def api_token_of_digest(session: Session, sha256: str) -> ApiToken | None:
    """The token whose sha256 is `sha256`, or None."""
    return session.scalar(select(ApiToken).where(ApiToken.sha256 == sha256))


def mark_api_token_used(session: Session, token_id: int, at: dt.datetime) -> None:
    """Stamp the token's last use `at` (one UPDATE, whatever the loaded row says)."""
    session.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=at))
    session.flush()
