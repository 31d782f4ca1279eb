"""The farm API's bearer tokens: made, listed, revoked and checked here (`farm api token ...`
and every request of the API). A token is "farm_" and 32 random bytes in URL-safe base64; the
store keeps only its sha256 (a hash of that much randomness cannot be guessed back, so no slow
password hash is needed) and its first characters, which tell tokens apart in a listing. The
token itself is shown once, when it is made.

Scopes: `read` reads everything; `triage` also acknowledges, invalidates and fixes alerts;
`run` also starts checks. `run` does not include `triage` (models.ApiScope says why)."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from orchestrator import store
from orchestrator.store.models import ApiScope, ApiToken, utcnow

TOKEN_PREFIX = "farm_"
PREFIX_CHARS = 12  # "farm_" and 7 characters of the random part, shown in listings
# A token's last use is written at most this often: on SQLite every write takes the store's
# write lock, which a busy client should not take on every request.
LAST_USED_EVERY = dt.timedelta(seconds=60)

# What each scope may do besides itself.
GRANTS: dict[ApiScope, frozenset[ApiScope]] = {
    ApiScope.read: frozenset({ApiScope.read}),
    ApiScope.triage: frozenset({ApiScope.read, ApiScope.triage}),
    ApiScope.run: frozenset({ApiScope.read, ApiScope.run}),
}


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: the token's id, name and scope."""

    token_id: int
    name: str
    scope: ApiScope

    def may(self, needed: ApiScope) -> bool:
        return needed in GRANTS[self.scope]


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def create_token(session: store.Session, scope: ApiScope | str, name: str = "") -> tuple[ApiToken, str]:
    """A new token of `scope`: its row, and the token itself (shown once, stored nowhere)."""
    try:
        scope = ApiScope(scope)
    except ValueError:
        raise store.StoreError(f"unknown scope {scope!r}; choose from {', '.join(ApiScope)}") from None
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return store.add_api_token(session, name=name, scope=scope, prefix=token[:PREFIX_CHARS], sha256=digest(token)), token


def list_tokens(session: store.Session) -> list[ApiToken]:
    return store.api_tokens(session)


def revoke_token(session: store.Session, token_id: int) -> ApiToken:
    """Revoke a token from its next request on; StoreError when there is no such token or it
    is revoked already."""
    row = store.find_api_token(session, token_id)
    if row is None:
        raise store.StoreError(f"no API token {token_id}; `farm api token list` shows them")
    if row.revoked_at is not None:
        raise store.StoreError(f"API token {token_id} was revoked already ({row.revoked_at:%Y-%m-%d %H:%M} UTC)")
    row.revoked_at = utcnow()
    session.flush()
    return row


def authenticate(session: store.Session, token: str) -> Caller | None:
    """The caller a presented token stands for, or None when it is unknown or revoked. Marks
    the token used (at most once a LAST_USED_EVERY)."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    wanted = digest(token)
    row = store.api_token_of_digest(session, wanted)
    # The lookup is by the hash's value; compare again in constant time all the same.
    if row is None or row.revoked_at is not None or not hmac.compare_digest(row.sha256, wanted):
        return None
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_EVERY:
        store.mark_api_token_used(session, row.id, now)
    return Caller(row.id, row.name, row.scope)
