"""A generation request coming in: its body (within the size limit), its id, its token estimates.

Everything here runs before the gateway decides where the request goes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from appliance.api.errors import ApiError
from appliance.api.inflight import Flight
from appliance.store import RequestRecord
from cascade.policy import Decision
from cascade.service import EscalationResult

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


def body_model(body: Any) -> str | None:
    """The model a body names, if it names one (for the request log of a refused request)."""
    return body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None


def prompt_text(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"], ensure_ascii=False)
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


def estimate_tokens(text: str) -> int:
    """About four bytes of text per token: admission only needs the order of magnitude, and
    tokenizing at the gateway would cost a round trip to the engine per request."""
    return max(1, len(text.encode()) // 4)


def max_tokens(parsed: Any) -> int | None:
    return getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens


@dataclass
class Job:
    """One generation request on its way through the gateway."""

    rec: RequestRecord
    t0: float
    body: dict  # what goes to the engine (the gateway adds usage and log-probability requests) ...
    original: dict  # ... and what the client sent, which is what an escalation forwards
    stream: bool
    client_wants_usage: bool
    cls: str
    tenant: str | None
    decision: Decision | None
    prompt_tokens: int  # estimated once (see estimate_tokens) for the policy, admission and prefill speed
    max_tokens: int | None
    flight: Flight  # its line in GET /v1/appliance/requests until the request log has it
    judge: bool = False  # auto policy: judge the local answer's confidence
    client_wants_logprobs: bool = False
    escalation: EscalationResult | None = None
