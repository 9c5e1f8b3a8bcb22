"""Shaping answers for the cascade: log-probabilities requested for the judge and hidden again, a whole
regional answer replayed as an OpenAI stream, and the headers that say who answered."""

from __future__ import annotations

import json
from typing import Any

from cascade.service import EscalationResult

TOP_K = 5  # top-k alternatives per token for the entropy signal
ANSWERED_BY = "X-Appliance-Answered-By"
ESCALATION = "X-Appliance-Escalation"
ESCALATION_ID = "X-Appliance-Escalation-Id"
ESCALATION_REASON = "X-Appliance-Escalation-Reason"
MODEL_DIGEST = "X-Appliance-Model-Digest"  # the pin of the model that answered locally (changes in an upgrade)


def request_logprobs(body: dict[str, Any], chat: bool) -> bool:
    """Ask the engine for token log-probabilities; True when the client had asked for them itself."""
    if chat:
        asked = body.get("logprobs") is True
        body["logprobs"] = True
        body["top_logprobs"] = max(int(body.get("top_logprobs") or 0), TOP_K)
        return asked
    asked = body.get("logprobs") is not None
    body["logprobs"] = max(int(body.get("logprobs") or 0), TOP_K)
    return asked


def hide_logprobs(data: dict[str, Any]) -> None:
    for choice in data.get("choices") or []:
        if isinstance(choice, dict) and "logprobs" in choice:
            choice["logprobs"] = None


def as_stream(answer: dict[str, Any], include_usage: bool) -> bytes:
    """A whole (regional) completion replayed as server-sent events of the matching chunk type."""
    chat = answer.get("object") == "chat.completion"
    base = {"id": answer.get("id", ""), "created": answer.get("created", 0), "model": answer.get("model", ""),
            "object": "chat.completion.chunk" if chat else "text_completion"}
    events = []
    for c in answer.get("choices") or []:
        idx = c.get("index", 0)
        if chat:
            msg = c.get("message") or {}
            delta = {"role": msg.get("role", "assistant"), "content": msg.get("content") or ""}
            choice = {"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}
            done = {"index": idx, "delta": {}, "logprobs": None, "finish_reason": c.get("finish_reason")}
        else:
            choice = {"index": idx, "text": c.get("text") or "", "logprobs": None, "finish_reason": None}
            done = {"index": idx, "text": "", "logprobs": None, "finish_reason": c.get("finish_reason")}
        events += [{**base, "choices": [choice]}, {**base, "choices": [done]}]
    if include_usage and answer.get("usage"):
        events.append({**base, "choices": [], "usage": answer["usage"]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def headers_for(result: EscalationResult | None, reason: str, answered_by: str) -> dict[str, str]:
    h = {ANSWERED_BY: answered_by}
    if result is None:
        return h
    state = {"answered": "answered", "queued": "queued", "rejected": "rejected", "outbox_full": "outbox-full"}
    h[ESCALATION] = state[result.outcome]
    if result.id:
        h[ESCALATION_ID] = result.id
    # header values must be latin-1; reasons are ours (ASCII), the cut keeps them short
    h[ESCALATION_REASON] = reason.encode("ascii", "replace").decode()[:200]
    return h


def sse_comment(text: str) -> bytes:
    """An SSE comment line: clients ignore it, a reader that looks finds the escalation there."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"
