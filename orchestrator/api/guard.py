"""The farm API's outer wall, an ASGI middleware in front of every route and page:

- a request with a body to /v1 is authenticated before a byte of the body is read (FastAPI
  parses a route's body before its dependencies run, so without this a caller with no token
  could make the server read and parse any amount): no token, or an unknown or revoked one, is
  a 401 at once (the route still checks the token's scope);
- every body is capped at `api_max_body_bytes`: a Content-Length above it is a 413 without
  reading anything, and a body sent without one (chunked) is read only until it passes the cap;
  a body must arrive within `api_request_deadline_s` of its head (408 otherwise);
- every answer carries a Content-Security-Policy (scripts, styles and connections only from
  the farm itself, `frame-ancestors 'none'`) and `X-Frame-Options: DENY`, so no other page
  (on another port of the same host, say) can frame the dashboard signed in from localStorage
  and click its triage buttons. The API's own documentation pages (/docs, /redoc) load Swagger
  UI and ReDoc from the farm too (vendored: orchestrator/api/static/vendor), and start them with
  an inline script and inline styles, which theirs allows; nothing comes from elsewhere.

Its own answers are errors of the API's one shape (schemas.Problem)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from anyio import fail_after, to_thread

from . import tokens
from .deps import BAD_TOKEN, BAD_TOKEN_CHALLENGE, CHALLENGE, NO_TOKEN
from .schemas import Problem

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
       "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
# /docs and /redoc (FastAPI's pages) start their vendored scripts with an inline script; ReDoc
# styles with inline styles and searches in a worker made from a blob.
DOCS_CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data: blob:; worker-src blob:; connect-src 'self'; object-src 'none'; "
            "base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
DOCS_PATHS = ("/docs", "/redoc")


class Guard:
    def __init__(self, app, sessions: Callable[[], Any], max_body_bytes: int, body_deadline_s: float = 10.0):
        self.app, self.sessions, self.max_body_bytes = app, sessions, max_body_bytes
        self.body_deadline_s = body_deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = _with_headers(send, DOCS_CSP if scope["path"].startswith(DOCS_PATHS) else CSP)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        length = headers.get(b"content-length")
        has_body = (length is not None and length.strip() not in (b"", b"0")) or b"transfer-encoding" in headers
        if not has_body:
            return await self.app(scope, receive, send)
        if scope["path"].startswith("/v1/"):
            refused = await self._unauthenticated(headers.get(b"authorization", b""))
            if refused is not None:
                return await _answer(send, 401, refused[0], refused[1])
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _answer(send, 400, "Content-Length is not a number")
            if declared > self.max_body_bytes:
                return await _answer(send, 413, self._too_large())
        body = bytearray()
        try:
            with fail_after(self.body_deadline_s):  # a body trickled a byte at a time holds nothing for long
                while True:  # read no further than the cap, then hand the app what came
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > self.max_body_bytes:
                        return await _answer(send, 413, self._too_large())
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await _answer(send, 408, f"the request body did not arrive within {self.body_deadline_s:g} s "
                                            "(api_request_deadline_s)")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"the request body is larger than this farm takes ({self.max_body_bytes:,} bytes: api_max_body_bytes)"

    async def _unauthenticated(self, authorization: bytes) -> tuple[str, bytes] | None:
        """Why the request's token is refused (the message and the WWW-Authenticate value), or None."""
        scheme, _, token = authorization.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return NO_TOKEN, CHALLENGE.encode()

        def lookup():
            with self.sessions() as db:
                who = tokens.authenticate(db, token.strip())
                db.commit()
                return who

        if await to_thread.run_sync(lookup) is None:
            return BAD_TOKEN, BAD_TOKEN_CHALLENGE.encode()
        return None


def _with_headers(send: Send, csp: str) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            present = {k.lower() for k, _ in message.get("headers", [])}
            extra = [(b"content-security-policy", csp.encode()), (b"x-frame-options", b"DENY"),
                     (b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
            message["headers"] = [*message.get("headers", []), *((k, v) for k, v in extra if k not in present)]
        await send(message)

    return sending


async def _answer(send: Send, status: int, detail: str, challenge: bytes | None = None) -> None:
    """A JSON error answered without reading the request's body; the connection is closed after
    it (the unread body is not waited for)."""
    body = json.dumps(Problem(detail=detail).model_dump()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if challenge is not None:
        headers.append((b"www-authenticate", challenge))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
