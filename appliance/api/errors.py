"""OpenAI-style errors: every failure the API returns has the body

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

and the status an OpenAI client expects, never a traceback.
"""

from __future__ import annotations

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

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return _AsciiJSON(self.body(), status_code=self.status, headers=self.headers)


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


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Logged with the traceback for the operator; the client gets no internals.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, "internal error in the appliance; see its log", code="internal_error").response()


def validation_error(errors: Sequence[Any]) -> ApiError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    detail = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}" for e in errors[:5]
    )
    return ApiError(422, f"invalid request: {detail}", code="invalid_type", param=param)
