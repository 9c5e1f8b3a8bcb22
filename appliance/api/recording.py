"""How a request ends up in the request log and the metrics, however it ends; and the one shape of
every error the gateway answers (the engine's own errors re-shaped to OpenAI's)."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from fastapi.responses import Response
from starlette.background import BackgroundTask

from appliance.api.errors import ApiError
from appliance.api.inflight import InFlight
from appliance.metrics import Metrics
from appliance.store import RequestLog, RequestRecord


class Recorder:
    def __init__(self, request_log: RequestLog | None, metrics: Metrics | None) -> None:
        self.request_log = request_log
        self.metrics = metrics
        self.inflight = InFlight()  # every generation request from its job to its request-log entry

    @property
    def keeps_text(self) -> bool:
        return self.request_log is not None and self.request_log.keep_text

    def record(self, rec: RequestRecord, t0: float) -> None:
        self.inflight.end(rec)
        rec.total_ms = (time.perf_counter() - t0) * 1000
        if self.metrics is not None:
            self.metrics.observe_request(rec, rec.extra.get("class"))
        if self.request_log is not None:
            self.request_log.record(rec)

    async def record_after_response(self, rec: RequestRecord, t0: float) -> None:
        # async on purpose: Starlette runs a plain-function background task in a worker thread,
        # a thread hop per request for what is only a queue put.
        self.record(rec, t0)

    def failed(self, rec: RequestRecord, t0: float, error: ApiError) -> ApiError:
        """The request ends with `error`: recorded, and the error carries the request's id. Raise it."""
        rec.status, rec.error_code = error.status, error.code
        self.record(rec, t0)
        error.headers.setdefault("X-Request-Id", rec.id)
        return error

    def client_gone(self, rec: RequestRecord, t0: float, status: int = 499,
                    code: str = "client_disconnected") -> Response:
        """The connection ended before an answer: 499 (nginx's "client closed request") when the client
        left, or the status the connection layer already sent. Nobody reads this response; the request
        log says what happened."""
        rec.status, rec.error_code = status, code
        self.record(rec, t0)
        return Response(status_code=status)

    def finish(self, rec: RequestRecord, t0: float, status: int, content: bytes, headers: dict) -> Response:
        """A whole (non-streamed) answer: usage and text taken for the log, an error re-shaped."""
        rec.status = status
        if status == 200:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                data = json.loads(content)
                take_usage(rec, data.get("usage"))
                if rec.prompt is not None:
                    rec.completion = completion_text(data)
        else:
            content, rec.error_code = normalise_error(status, content)
        return Response(content, status_code=status, media_type="application/json", headers=headers,
                        background=BackgroundTask(self.record_after_response, rec, t0))


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
