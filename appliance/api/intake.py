"""A generation request coming in: its body (within the size limit), its id, its token estimates.

Everything here runs before the gateway decides where the request goes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from fastapi import Request

from appliance.api.errors import ApiError

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_JSON_DEPTH = 64  # OpenAI request bodies nest a handful of levels (messages, content parts, tools' schemas)
# A JSON escape of a UTF-16 surrogate: only these can decode to text that is not valid Unicode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # unrolled: one tight loop per run of plain characters
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def request_id(request: Request) -> str:
    """The client's X-Request-Id when it is a plain token; anything else (it reaches vLLM and the logs)
    is replaced."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else new_request_id()


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused with 413 once it passes `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
    if _depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        # Decoded here, strictly: json.loads(bytes) would decode with "surrogatepass" and let the bytes of
        # a lone surrogate through as one, past the escape check below (found by the fuzz suite).
        text = raw.decode("utf-8-sig")  # a leading BOM is tolerated, as json.loads(bytes) did
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not UTF-8 (byte {e.start}: {e.reason}); JSON must be",
                       code="invalid_json") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk the body for the field to name
        where = _not_unicode(body, "")
        if where is not None:
            raise ApiError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate escape, which is not Unicode "
                           "text; send each character as UTF-8 or as a complete surrogate pair",
                           code="invalid_text", param=where or None)
    return body


def _depth(raw: bytes) -> int:
    """How deep the JSON nests, counted before parsing so no parser recurses on a hostile body: strings
    are taken out (they may hold brackets), then only brackets are left to count."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for c in brackets:
        if c in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    break
        else:
            depth -= 1
    return deepest


def _not_unicode(value: Any, path: str) -> str | None:
    """The path of the first string (or key) that cannot be encoded as UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items: Any = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k)
        if isinstance(k, str) and _not_unicode(k, where) is not None:
            return where
        found = _not_unicode(v, where)
        if found is not None:
            return found
    return None


def body_model(body: Any) -> str | None:
    """The model a body names, if it names one (for the request log of a refused request)."""
    return body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None


def estimate_tokens(text: str) -> int:
    """About four bytes of text per token: admission only needs the order of magnitude, and
    tokenizing at the gateway would cost a round trip to the engine per request."""
    return max(1, len(text.encode()) // 4)


def max_tokens(parsed: Any) -> int | None:
    """The output limit the engine will apply. Chat reads max_completion_tokens first, as vLLM does; a
    completion request has no such field (vLLM ignores it there), so here it is any JSON value, unchecked,
    and must count for nothing. The Responses API's limit is max_output_tokens."""
    if "max_output_tokens" in type(parsed).model_fields:
        return parsed.max_output_tokens
    if "max_completion_tokens" in type(parsed).model_fields:
        return parsed.max_completion_tokens or parsed.max_tokens
    return parsed.max_tokens
