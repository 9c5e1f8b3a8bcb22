"""API-key access control for every route but /healthz and /readyz.

Unlike vLLM's own --api-key (which guards only /v1 routes), the key is checked before routing, so an
unknown route is 401 too and nothing answers unauthenticated but the two probes. /v1/appliance/* needs a
key created with --admin. /v1/escalations* shows an admin key every escalation and any other key only
its own (the application that got an escalation id must be able to fetch its answer). The status page
(GET / and /status) is admin scope too; a browser cannot send a Bearer header, so a key is also taken
as HTTP Basic credentials (the key as the password, any user name), and a 401 there asks the browser
for them. Keys are never logged: the request log records the key's public id only.

A plain ASGI middleware, not Starlette's BaseHTTPMiddleware, which would wrap every streamed event.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from appliance.api.errors import ApiError
from appliance.boot.net import is_loopback
from appliance.store.keys import KeyVerifier

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
ADMIN_PREFIXES = ("/v1/appliance/",)
PAGE_PATHS = frozenset({"/", "/status"})  # the status page, read in a browser


def keys_required(mode: str, host: str) -> bool:
    return mode == "always" or (mode == "auto" and not is_loopback(host))


def _presented_key(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            if scheme.lower() == "basic" and token.strip():
                return _basic_password(token.strip())
        elif name == b"x-api-key" and value:
            return value.decode("latin-1").strip()
    return None


def _basic_password(token: str) -> str | None:
    """The password of HTTP Basic credentials (the user name when the password is empty), or None."""
    try:
        user, _, password = base64.b64decode(token, validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (password or user).strip() or None


def _admin_only(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES) or path in PAGE_PATHS


class ApiKeyAuth:
    def __init__(self, app: Any, verifier: KeyVerifier, required: bool) -> None:
        self.app = app
        self.verifier = verifier
        self.required = required

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # "/healthz/" too: a probe configured with a trailing slash gets the redirect, not a 401
        if scope["type"] != "http" or scope["path"].rstrip("/") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = _presented_key(scope)
        key = await self.verifier.verify_async(token) if token is not None else None
        if token is not None and key is None:
            if self.required:
                await _deny(scope, receive, send, 401, "the API key is not valid or has been revoked", "invalid_api_key")
                return
            # Keys not required (loopback): OpenAI clients always send some key, often a placeholder;
            # an unrecognised one means an anonymous caller, not an error.
        elif token is None and self.required:
            await _deny(scope, receive, send, 401,
                        "an API key is required: send 'Authorization: Bearer <key>' (create one with "
                        "`appliance keys create`)", "missing_api_key")
            return
        if _admin_only(scope["path"]) and self.required and not (key and key.admin):
            await _deny(scope, receive, send, 403, "this route needs an admin key (`appliance keys create --admin`)",
                        "admin_scope_required")
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


async def _deny(scope: Any, receive: Any, send: Any, status: int, message: str, code: str) -> None:
    challenge = 'Basic realm="appliance status", charset="UTF-8"' if scope["path"] in PAGE_PATHS else "Bearer"
    headers = {"WWW-Authenticate": challenge} if status == 401 else {}
    await ApiError(status, message, code=code, headers=headers).response(scope["path"])(scope, receive, send)
