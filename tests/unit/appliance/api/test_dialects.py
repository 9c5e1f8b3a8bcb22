"""The Responses and Messages APIs through the gateway's one path (appliance.api.dialects): the class's
output limit in each API's own field, usage and text taken from each API's answers (whole and streamed,
with their `event:` lines), nothing stripped that the client did not get from the engine, Anthropic's
error shape on its routes, and a policy that would escalate refused where the cascade cannot go."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import httpx
import pytest

from appliance.api.admission import AdmissionConfig, AdmissionGate, ClassPolicy
from appliance.api.dialects import MESSAGES, RESPONSES
from appliance.api.errors import ApiError
from appliance.api.route_choice import Local, Refuse, choose_route
from appliance.store import keys
from cascade.policy import Decision
from tests.unit.appliance.api.inprocess import serving

RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "model": "m",
            "output": [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "Paris", "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
           "content": [{"type": "text", "text": "Paris"}], "stop_reason": "end_turn",
           "usage": {"input_tokens": 4, "output_tokens": 6}}


def _sse(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


RESPONSE_STREAM = [
    _sse("response.created", {"type": "response.created", "response": {**RESPONSE, "status": "in_progress",
                                                                         "usage": None}}),
    _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Par"}),
    _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "is"}),
    _sse("response.completed", {"type": "response.completed", "response": RESPONSE}),
]
MESSAGE_STREAM = [
    _sse("message_start", {"type": "message_start", "message": {**MESSAGE, "content": [],
                                                                 "usage": {"input_tokens": 4, "output_tokens": 1}}}),
    _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                                                        "text": "Paris"}}),
    _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                           "usage": {"output_tokens": 6}}),
    _sse("message_stop", {"type": "message_stop"}),
]


class Engine:
    """Answers each route as vLLM would, and keeps what the gateway sent it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.seen.append((request.url.path, body))
        if body.get("max_tokens") == 13:  # the engine refuses, in Anthropic's shape as vLLM does there
            return httpx.Response(400, json={"type": "error", "error": {"type": "BadRequestError",
                                                                        "message": "no thirteen"}})
        if request.url.path == "/v1/messages/count_tokens":
            if not body.get("messages"):  # vLLM's refusal there, in its OpenAI shape: re-shaped on the way
                return httpx.Response(400, json={"error": {"message": "messages: Field required",
                                                           "type": "BadRequestError", "code": 400}})
            return httpx.Response(200, json={"input_tokens": 7})
        if body.get("stream"):
            events = RESPONSE_STREAM if request.url.path == "/v1/responses" else MESSAGE_STREAM

            async def chunks():
                for e in events:
                    yield e
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())
        return httpx.Response(200, json=RESPONSE if request.url.path == "/v1/responses" else MESSAGE)


def _gate() -> AdmissionGate:
    return AdmissionGate(AdmissionConfig(4, {"gold": ClassPolicy(5.0, None, 8), "silver": ClassPolicy(5.0, None, 8),
                                             "bronze": ClassPolicy(5.0, 16, 8)}))


def _post(app, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, headers=headers or {})
    return asyncio.run(go())


def _rows(db) -> list[tuple]:
    import time
    for _ in range(100):
        with sqlite3.connect(db) as c:
            rows = c.execute("select route, status, prompt_tokens, completion_tokens, error_code from requests "
                             "order by ts").fetchall()
        if rows:
            return rows
        time.sleep(0.05)
    return []


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_takes_the_class_limit_in_max_output_tokens_and_its_usage_is_logged(tmp_path, stream):
    engine = Engine()
    made = serving(tmp_path, engine, admission=_gate())
    bronze = keys.create(made.cfg.database_path, "b", priority_class="bronze")[1]
    try:
        r = _post(made.app, "/v1/responses", {"model": "m", "input": "Capital of France?", "stream": stream},
                  {"Authorization": f"Bearer {bronze}"})
        assert r.status_code == 200, r.text
        if stream:
            assert r.content == b"".join(RESPONSE_STREAM)  # passed on as the engine wrote it, nothing stripped
        else:
            assert r.json()["output"][0]["content"][0]["text"] == "Paris"
        path, sent = engine.seen[0]
        assert path == "/v1/responses" and sent["max_output_tokens"] == 16
        assert "max_tokens" not in sent and "stream_options" not in sent  # the Responses API has neither
        assert _rows(made.cfg.database_path) == [("/v1/responses", 200, 3, 5, None)]
        over = _post(made.app, "/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 17},
                     {"Authorization": f"Bearer {bronze}"})
        assert over.status_code == 400 and over.json()["error"]["code"] == "max_tokens_over_class_limit"
    finally:
        made.log.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_is_answered_and_logged_in_anthropic_s_terms(tmp_path, stream):
    engine = Engine()
    made = serving(tmp_path, engine)
    body = {"model": "m", "max_tokens": 32, "stream": stream, "messages": [{"role": "user", "content": "Capital?"}]}
    try:
        r = _post(made.app, "/v1/messages", body, {"x-api-key": "anything-on-loopback"})
        assert r.status_code == 200, r.text
        if stream:
            assert r.content == b"".join(MESSAGE_STREAM)
        else:
            assert r.json()["content"][0]["text"] == "Paris"
        assert "stream_options" not in engine.seen[0][1]
        assert _rows(made.cfg.database_path) == [("/v1/messages", 200, 4, 6, None)]
        counted = _post(made.app, "/v1/messages/count_tokens", {"model": "m", "messages": body["messages"]})
        assert counted.status_code == 200 and counted.json() == {"input_tokens": 7}
    finally:
        made.log.close()


def test_the_messages_routes_answer_errors_in_anthropic_s_shape(tmp_path):
    made = serving(tmp_path, Engine())
    msg = [{"role": "user", "content": "hi"}]
    try:
        missing = _post(made.app, "/v1/messages", {"model": "m", "messages": msg})  # max_tokens is required
        refused = _post(made.app, "/v1/messages", {"model": "m", "max_tokens": 13, "messages": msg})
        unknown = _post(made.app, "/v1/messages", {"model": "other", "max_tokens": 5, "messages": msg})
        empty = _post(made.app, "/v1/messages/count_tokens", {})
        chat = _post(made.app, "/v1/chat/completions", {"model": "other", "messages": msg})
    finally:
        made.log.close()
    for r, status, kind in ((missing, 422, "invalid_request_error"), (refused, 400, "invalid_request_error"),
                            (unknown, 404, "not_found_error")):
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    assert "no thirteen" in refused.json()["error"]["message"]
    assert empty.status_code == 400 and empty.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "messages: Field required"}}
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"  # OpenAI's shape elsewhere


def test_a_missing_or_revoked_key_on_the_messages_route_is_anthropic_s_401(tmp_path):
    from tests.unit.appliance.api.inprocess import call, gateway

    made = gateway(tmp_path, required=True)
    try:
        r = call(made.app, "POST", "/v1/messages", key="sk-wrong", header="x-api-key",
                 json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    finally:
        made.log.close()
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error" and r.json()["type"] == "error"


NOT_READY = ApiError(503, "loading", code="engine_not_ready")


@pytest.mark.parametrize(("decision", "model", "ready", "expected"), [
    (None, "m", True, Local()),
    (Decision("local_then_judge", "async", "auto", True), "m", True, Local()),  # not judged: no log-probabilities
    (Decision("local", "async", "x", True), "m", False, Refuse(NOT_READY)),  # no regional answer to fall back on
])
def test_routes_the_cascade_does_not_speak_are_answered_locally(decision, model, ready, expected):
    assert choose_route(decision, model=model, served_name="m", serves_regionally=True,
                        engine_refusal=None if ready else NOT_READY, link_usable=True,
                        escalable=False) == expected


@pytest.mark.parametrize("dialect", [RESPONSES, MESSAGES])
def test_a_policy_that_would_escalate_such_a_route_is_refused_saying_so(dialect):
    way = choose_route(Decision("escalate_now", "sync", "tenant policy: always", True), model="m", served_name="m",
                       serves_regionally=False, engine_refusal=None, link_usable=True, escalable=dialect.cascade)
    assert isinstance(way, Refuse) and (way.error.status, way.error.code) == (400, "escalation_unsupported")
    regional_only = choose_route(None, model="big", served_name="m", serves_regionally=True, engine_refusal=None,
                                 link_usable=True, escalable=dialect.cascade)
    assert isinstance(regional_only, Refuse) and regional_only.error.status == 404


def test_auto_tool_choice_is_refused_where_the_plan_says_the_model_is_not_shown_its_tools(tmp_path):
    """Before a tool's result, in each API's own words for auto; after one, or with a named or required
    choice, the request goes to the engine."""
    import dataclasses

    engine = Engine()
    made = serving(tmp_path, engine)
    made.gateway.settings = dataclasses.replace(made.gateway.settings, auto_tool_choice=False)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    result = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"}]
    anthropic_tool = {"name": "f", "input_schema": {"type": "object"}}
    msg = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [anthropic_tool]}
    try:
        refused = [_post(made.app, "/v1/chat/completions", chat),
                   _post(made.app, "/v1/chat/completions", {**chat, "tool_choice": "auto"}),
                   _post(made.app, "/v1/responses", {"model": "m", "input": "hi", "tools": [
                       {"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
                   _post(made.app, "/v1/messages", msg)]
        passed = [_post(made.app, "/v1/chat/completions", {**chat, "tool_choice": "required"}),
                  _post(made.app, "/v1/chat/completions", {**chat, "messages": chat["messages"] + result}),
                  _post(made.app, "/v1/messages", {**msg, "tool_choice": {"type": "any"}})]
    finally:
        made.log.close()
    assert [r.status_code for r in refused] == [400] * 4
    assert [r.json()["error"].get("code") for r in refused[:3]] == ["tool_choice_unsupported"] * 3
    assert refused[3].json()["type"] == "error" and "tool_choice" in refused[3].json()["error"]["message"]
    assert [r.status_code for r in passed] == [200] * 3 and len(engine.seen) == 3


def test_a_revoked_key_is_refused_on_every_new_route(tmp_path):
    from tests.unit.appliance.api.inprocess import call, gateway

    made = gateway(tmp_path, required=True)
    key, secret = keys.create(made.cfg.database_path, "app")
    keys.revoke(made.cfg.database_path, key.id)
    routes = [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models/m")]
    try:
        answers = {path: call(made.app, method, path, key=secret, json={"model": "m"}) for method, path in routes}
        messages = call(made.app, "POST", "/v1/messages", key=secret, header="x-api-key", json={"model": "m"})
    finally:
        made.log.close()
    assert {p: r.status_code for p, r in answers.items()} == {p: 401 for _, p in routes}
    assert messages.status_code == 401 and messages.json()["error"]["type"] == "authentication_error"
