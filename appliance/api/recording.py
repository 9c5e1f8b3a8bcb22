"""What an answer gives the request log (usage, text), and the one shape of every error the gateway
answers (the engine's own errors re-shaped to OpenAI's). The exchange (appliance.api.exchange) records."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from appliance.api.errors import ApiError
from appliance.store.requests import RequestRecord


def take_usage(rec: RequestRecord, usage: Any) -> None:
    if isinstance(usage, dict):
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")


def completion_text(data: dict, delta: bool = False) -> str:
    out = []
    for c in data.get("choices") or []:
        if delta:
            out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
        else:
            out.append((c.get("message") or {}).get("content") or c.get("text") or "")
    return "".join(out)


def normalise_error(status: int, content: bytes) -> tuple[bytes, str | None]:
    """Re-shape the engine's error into the OpenAI body with an OpenAI error type.

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
    body = ApiError(status, message, code=code, param=param if isinstance(param, str) else None).body()
    return json.dumps(body).encode(), code
