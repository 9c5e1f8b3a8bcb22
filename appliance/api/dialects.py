"""The generation routes' dialects: what the gateway needs to know of each API it passes to the engine.

Every generation route (OpenAI chat and completions, OpenAI Responses, Anthropic Messages) goes through
the same gateway path (keys and classes, admission, the exchange, the splice); a `Dialect` says what
differs: the body's checked fields, where its prompt and its output limit are, where its answer's usage
and text are (whole and streamed), whether the stream can be asked for a usage event, whether the cascade
can judge or escalate it, and the shape of its errors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from appliance.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    ResponsesRequest,
    _Common,
)

ErrorShape = Literal["openai", "anthropic"]


def _chat_prompt(body: dict) -> str:
    return json.dumps(body.get("messages"), ensure_ascii=False)


def _completion_prompt(body: dict) -> str:
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


def _responses_prompt(body: dict) -> str:
    given = body.get("input")
    text = given if isinstance(given, str) else json.dumps(given, ensure_ascii=False)
    instructions = body.get("instructions")
    return f"{instructions}\n{text}" if isinstance(instructions, str) else text


def _messages_prompt(body: dict) -> str:
    system = body.get("system")
    text = json.dumps(body.get("messages"), ensure_ascii=False)
    return f"{json.dumps(system, ensure_ascii=False)}\n{text}" if system is not None else text


def _openai_usage(data: dict) -> dict | None:
    usage = data.get("usage")
    return usage if isinstance(usage, dict) else None


def _responses_usage(data: dict) -> dict | None:
    """A whole response carries its usage; a stream's only in its last event, response.completed."""
    inner = data.get("response")
    usage = (inner if isinstance(inner, dict) else data).get("usage")
    return usage if isinstance(usage, dict) else None


def _messages_usage(data: dict) -> dict | None:
    """A whole message's usage; streamed: message_start's (input tokens), then message_delta's (output)."""
    if isinstance(data.get("message"), dict):
        data = data["message"]
    usage = data.get("usage")
    return usage if isinstance(usage, dict) else None


def _openai_text(data: dict, delta: bool) -> str:
    out = []
    for c in data.get("choices") or []:
        if not isinstance(c, dict):
            continue
        part = (c.get("delta") if delta else c.get("message")) or {}
        out.append(part.get("content") or c.get("text") or "")
    return "".join(x for x in out if isinstance(x, str))


def _responses_text(data: dict, delta: bool) -> str:
    if delta:
        return data["delta"] if data.get("type") == "response.output_text.delta" and isinstance(
            data.get("delta"), str) else ""
    out = []
    for item in data.get("output") or []:
        for part in (item.get("content") or []) if isinstance(item, dict) else []:
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("text"), str):
                out.append(part["text"])
    return "".join(out)


def _messages_text(data: dict, delta: bool) -> str:
    if delta:
        d = data.get("delta") if data.get("type") == "content_block_delta" else None
        return d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else ""
    return "".join(b["text"] for b in data.get("content") or []
                   if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))


def _openai_auto_tools(body: dict) -> bool:
    """Tools given and the choice left to the model (tool_choice "auto", also the default) before any tool
    result: the turn where the model would have to pick a tool it may not be shown. A turn after a tool's
    result is usually answered in text, which works whatever the template."""
    if not body.get("tools") or body.get("tool_choice", "auto") not in ("auto", None):
        return False
    items = body.get("messages") if "messages" in body else body.get("input")
    items = items if isinstance(items, list) else []
    return not any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("type") == "function_call_output")
                   for m in items)


def _anthropic_auto_tools(body: dict) -> bool:
    choice = body.get("tool_choice")
    if not body.get("tools") or not (choice is None or (isinstance(choice, dict) and choice.get("type") == "auto")):
        return False
    given = body.get("messages")
    messages: list = given if isinstance(given, list) else []
    return not any(isinstance(m, dict) and isinstance(m.get("content"), list) and
                   any(isinstance(b, dict) and b.get("type") == "tool_result" for b in m["content"])
                   for m in messages)


@dataclass(frozen=True)
class Dialect:
    route: str
    schema: type[_Common]
    prompt_text: Callable[[dict], str]
    limit_field: str  # where the class's output limit goes when the client left it out
    usage_of: Callable[[dict], dict | None]
    text_of: Callable[[dict, bool], str]  # an answer's text (True: of one streamed event)
    auto_tools: Callable[[dict], bool] = _openai_auto_tools  # the body leaves the tool choice to the model
    stream_usage: bool = False  # the engine takes stream_options.include_usage (the gateway asks for it)
    cascade: bool = False  # the cascade's regional client and judge speak this dialect
    errors: ErrorShape = "openai"


CHAT = Dialect("/v1/chat/completions", ChatCompletionRequest, _chat_prompt, "max_tokens", _openai_usage, _openai_text,
               stream_usage=True, cascade=True)
COMPLETIONS = Dialect("/v1/completions", CompletionRequest, _completion_prompt, "max_tokens", _openai_usage,
                      _openai_text, stream_usage=True, cascade=True)
RESPONSES = Dialect("/v1/responses", ResponsesRequest, _responses_prompt, "max_output_tokens", _responses_usage,
                    _responses_text)
MESSAGES = Dialect("/v1/messages", MessagesRequest, _messages_prompt, "max_tokens", _messages_usage, _messages_text,
                   _anthropic_auto_tools, errors="anthropic")

BY_ROUTE = {d.route: d for d in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}


def take_usage(rec: Any, usage: dict | None) -> None:
    """Token counts into the request's record, in either vocabulary (OpenAI's prompt/completion, or the
    Responses and Anthropic APIs' input/output); a key that is absent leaves what an earlier event set."""
    if not isinstance(usage, dict):
        return
    for ours, names in (("prompt_tokens", ("prompt_tokens", "input_tokens")),
                        ("completion_tokens", ("completion_tokens", "output_tokens"))):
        for name in names:
            if isinstance(usage.get(name), int):
                setattr(rec, ours, usage[name])
                break
