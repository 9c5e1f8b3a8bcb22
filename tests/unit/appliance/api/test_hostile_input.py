"""Bodies that used to reach the gateway's 500 path (issue 15): lone surrogates and deep nesting get a
400 that names the field, are recorded in the request log, and never reach the engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from appliance.store.requests import recent_requests
from tests.unit.appliance.api.inprocess import serving

BAD = "\ud800"  # json.dumps writes it as the escape \ud800: valid JSON, not Unicode text


def _chat(**message) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi", **message}]}


CASES = [
    ("/v1/chat/completions", {**_chat(), "model": BAD}, "model"),
    ("/v1/chat/completions", _chat(content=f"hi {BAD}"), "messages[0].content"),
    ("/v1/chat/completions", _chat(content=[{"type": "text", "text": BAD}]), "messages[0].content[0].text"),
    ("/v1/chat/completions", _chat(name=BAD), "messages[0].name"),
    ("/v1/chat/completions", {**_chat(), "stop": ["ok", BAD]}, "stop[1]"),
    ("/v1/chat/completions", {**_chat(), "metadata": {BAD: "x"}}, "metadata." + BAD),
    ("/v1/completions", {"model": "m", "prompt": BAD}, "prompt"),
]


@pytest.fixture
def served(tmp_path):
    seen: list[dict] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "ok"}}]})

    made = serving(tmp_path, engine)

    def post(route: str, raw: bytes) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
                return await c.post(route, content=raw, headers={"content-type": "application/json"})

        return asyncio.run(go())

    yield post, seen, made
    made.log.close()


@pytest.mark.parametrize(("route", "body", "field"), CASES, ids=[c[2] for c in CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(served, route, body, field):
    post, seen, made = served
    r = post(route, json.dumps(body).encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_text" and err["type"] == "invalid_request_error", err
    assert err["param"].encode("utf-8", "replace") == field.encode("utf-8", "replace"), err
    assert seen == []  # the engine never saw it
    made.log.close()
    rows = recent_requests(made.cfg.database_path)
    assert [(row["status"], row["error_code"]) for row in rows] == [(400, "invalid_text")]


def test_a_surrogate_pair_is_ordinary_text(served):
    post, seen, _ = served
    r = post("/v1/chat/completions", json.dumps(_chat(content="smile \U0001f600")).encode())  # \ud83d\ude00
    assert r.status_code == 200, r.text
    assert seen[0]["messages"][0]["content"] == "smile \U0001f600"


@pytest.mark.parametrize("depth", [65, 1_000, 100_000])
def test_deep_nesting_is_a_400_before_any_parser_recurses(served, depth):
    post, seen, _made = served
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":' + b"[" * depth + b"]" * depth + b"}"
    r = post("/v1/chat/completions", raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json" and "deeper than 64" in r.json()["error"]["message"]
    assert seen == []


def test_nesting_within_the_bound_passes(served):
    post, seen, _ = served
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x":' + b"[" * 60 + b"]" * 60 + b"}"
    assert post("/v1/chat/completions", raw).status_code == 200
    assert len(seen) == 1


def test_a_fault_in_the_gateway_is_logged_once_counted_and_recorded(served, monkeypatch, caplog):
    """Issue 15: the gateway's own 500s were in neither the request log nor the metrics and wrote two
    tracebacks each. Any fault inside the gateway now ends like every other failed request."""
    import appliance.api.gateway as gw

    post, seen, made = served

    def broken(text: str) -> int:
        raise ValueError("a bug")

    monkeypatch.setattr(gw, "estimate_tokens", broken)
    with caplog.at_level("ERROR"):
        r = post("/v1/chat/completions", json.dumps(_chat()).encode())
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal_error" and r.headers["x-request-id"] in err["message"]
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None, [e.getMessage() for e in errors]
    assert seen == []
    metrics = made.gateway.metrics.render().decode()
    assert 'appliance_requests_total{class="silver",route="/v1/chat/completions",status="500"} 1.0' in metrics
    assert 'appliance_internal_errors_total{route="/v1/chat/completions"} 1.0' in metrics
    made.log.close()
    rows = recent_requests(made.cfg.database_path)
    assert [(row["status"], row["error_code"]) for row in rows] == [(500, "internal_error")]


def test_a_fault_on_any_other_route_is_logged_once_counted_and_answered(served, monkeypatch, caplog):
    """Outside the generation routes a fault went to Starlette's handler, which re-raises it: two
    tracebacks and a closed connection (httpx's ASGI transport raises it here). Now one log record, a
    count by route template, and the OpenAI-style 500."""
    _, _, made = served

    def broken() -> str:
        raise ValueError("a bug")

    monkeypatch.setattr(made.gateway, "require_ready", broken)

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            return await c.get("/v1/models")

    with caplog.at_level("ERROR"):
        r = asyncio.run(get())
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "internal_error" and r.json()["error"]["type"] == "server_error"
    errors = [rec for rec in caplog.records if rec.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None, [e.getMessage() for e in errors]
    assert "ValueError in the appliance on GET /v1/models" in errors[0].getMessage()
    assert 'appliance_internal_errors_total{route="/v1/models"} 1.0' in made.gateway.metrics.render().decode()


def test_a_client_leaving_mid_upload_is_a_499_not_an_error(served, caplog):
    """Issue 15: 3,000 clients closing mid-upload wrote 20 MB of tracebacks and stalled the loop."""
    _, seen, made = served
    sent: list[dict] = []
    messages = iter([{"type": "http.request", "body": b'{"model":"m","mess', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"400")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    with caplog.at_level("WARNING"):
        asyncio.run(made.app(scope, receive, send))
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert seen == []
    made.log.close()
    rows = recent_requests(made.cfg.database_path)
    assert [(row["status"], row["error_code"]) for row in rows] == [(499, "client_disconnected")]


def test_a_surrogate_sent_as_raw_bytes_is_a_400_not_a_500(served):
    """Found by the fuzz suite: a lone surrogate written as its three bytes (WTF-8), not as an escape,
    went through json.loads(bytes), which decodes with surrogatepass, and broke the token estimate: 500."""
    post, seen, made = served
    body = json.dumps(_chat(content=f"hi {BAD}"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    assert b"\xed\xa0\x80" in body
    r = post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json" and "not UTF-8" in r.json()["error"]["message"]
    assert seen == []
    bom = post("/v1/chat/completions", b"\xef\xbb\xbf" + json.dumps(_chat()).encode())  # tolerated, as before
    assert bom.status_code == 200, bom.text
    made.log.close()
    rows = recent_requests(made.cfg.database_path)
    assert sorted((row["status"], row["error_code"]) for row in rows) == [(200, None), (400, "invalid_json")]


def test_a_stream_the_engine_refuses_in_its_first_event_is_a_400(tmp_path):
    """Found by the fuzz suite: vLLM checks some requests only after its 200 (a completion prompt that
    tokenizes to nothing), so the client got 200 and an error event. The gateway reads the first event
    before its own headers go out: an error there is answered with its status and an OpenAI body."""
    from tests.unit.appliance.api.inprocess import serving

    def engine(request: httpx.Request) -> httpx.Response:
        refusal = b'data: {"error": {"message": "The decoder prompt cannot be empty", "type": "BadRequestError", ' \
                  b'"param": null, "code": 400}}\n\ndata: [DONE]\n\n'
        ok = b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n'
        empty = json.loads(request.content)["prompt"] == "\u0006"

        async def events():  # streamed, as the engine's answer is
            yield refusal if empty else ok

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    made = serving(tmp_path, engine)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            bad = await c.post("/v1/completions", json={"model": "m", "prompt": "\u0006", "stream": True})
            good = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
            return bad, good

    bad, good = asyncio.run(go())
    made.log.close()
    assert bad.status_code == 400 and bad.headers["content-type"] == "application/json", bad.text
    err = bad.json()["error"]
    assert err["code"] == "engine_rejected" and "decoder prompt cannot be empty" in err["message"], err
    assert good.status_code == 200 and good.text.endswith("data: [DONE]\n\n") and '"text":"a"' in good.text
    rows = recent_requests(made.cfg.database_path)
    assert sorted((row["status"], row["error_code"]) for row in rows) == [(200, None), (400, "engine_rejected")]
