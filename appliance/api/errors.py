"""Errors in the shape the route's clients expect: every failure the API returns has OpenAI's body

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

except on Anthropic's Messages routes (/v1/messages...), where it has Anthropic's

    {"type": "error", "error": {"type": ..., "message": ...}}

and the status those clients expect, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


# Anthropic's error types by status (its API's documented errors); 5xx other than these: api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self, path: str = "") -> dict[str, Any]:
        """The error's body in the shape of the route at `path` (OpenAI's unless an Anthropic route)."""
        if anthropic_route(path):
            return anthropic_body(self.status, self.message)
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return _AsciiJSON(self.body(path), status_code=self.status, headers=self.headers)


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: a message or param that quotes the client's input
    renders even when that input is not Unicode text (a lone surrogate), instead of failing the error."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def retry_later(status: int, message: str, code: str, retry_after_s: int | float,
                headers: dict[str, str] | None = None, param: str | None = None) -> ApiError:
    """A refusal the client should retry (429, 503): Retry-After says when, in whole seconds."""
    return ApiError(status, message, code=code, param=param,
                    headers={"Retry-After": str(max(1, round(retry_after_s))), **(headers or {})})


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        error = ApiError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None))
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Logged with the traceback for the operator; the client gets no internals.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        error = ApiError(500, "internal error in the appliance; see its log", code="internal_error")
        return error.response(request.url.path)


def validation_error(errors: Sequence[Any]) -> ApiError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    detail = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
    )
    return ApiError(422, f"invalid request: {detail}", code="invalid_type", param=param)


def normalise_error(status: int, content: bytes, path: str = "") -> tuple[bytes, str | None]:
    """Re-shape the engine's error into the body of the route at `path` (OpenAI's, or Anthropic's on the
    Messages routes) with that API's error type.

    vLLM answers {"error": {"message", "type": "BadRequestError", "param", "code": 400}}:
    the right idea with a Python class name for the type and the status as the code.
    Clients switch on `type` and `code`, so those are mapped; message and param are kept.
    """
    message, param, code = None, None, None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        data = json.loads(content)
        err = data.get("error") if isinstance(data.get("error"), dict) else data
        if isinstance(err.get("message"), str):
            message, param = err["message"], err.get("param")
            code = err.get("code") if isinstance(err.get("code"), str) else None
    if message is None:
        message = f"the engine answered {status}: {content.decode('utf-8', 'replace')[:500]}"
    code = code or ("engine_rejected" if status < 500 else "engine_error")
    body = ApiError(status, message, code=code, param=param if isinstance(param, str) else None).body(path)
    return json.dumps(body).encode(), code
