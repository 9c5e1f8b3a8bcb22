"""Gateway behaviour that needs no engine: the real app in-process."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from tests.unit.appliance.api.inprocess import app, call, serving

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_request_ids_from_clients_are_kept_only_when_plain(tmp_path):
    _cfg, application, log = app(tmp_path, required=False)
    try:
        async def go(rid: str) -> str:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://t") as c:
                r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": rid})
                return r.headers["x-request-id"]

        assert asyncio.run(go("order-42.a:b")) == "order-42.a:b"
        replaced = asyncio.run(go("x" * 500))
        assert replaced.startswith("req-") and len(replaced) < 64
        assert asyncio.run(go("bad id\twith tab")).startswith("req-")
    finally:
        log.close()


def test_requests_in_flight_show_their_phase_and_how_far_a_stream_got(tmp_path):
    """GET /v1/appliance/requests: a stream the engine has begun shows as streaming with a chunk from the
    engine handed to the client; once it ends, and after an engine error, the list is empty again."""

    release = threading.Event()  # the engine answers in its own thread (tests/unit/appliance/api/scripted_engine.py)

    async def events():
        yield b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        await asyncio.to_thread(release.wait, 10)
        yield b'data: {"choices":[{"index":0,"text":"b"}]}\n\ndata: [DONE]\n\n'

    def engine(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("max_tokens") == 1:
            return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

    made = serving(tmp_path, engine)
    application, log, gw = made.app, made.log, made.gateway

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://t") as c:
            # httpx's ASGI transport hands the body over only once it is complete: the stream is a task
            streaming = asyncio.create_task(c.post("/v1/completions", json={
                "model": "m", "prompt": "hi", "stream": True}, headers={"X-Request-Id": "held-1"}))
            for _ in range(200):
                during = (await c.get("/v1/appliance/requests")).json()
                if during["data"] and during["data"][0]["chunks_to_client"]:
                    break
                await asyncio.sleep(0.01)
            release.set()
            done = await streaming
            after = (await c.get("/v1/appliance/requests")).json()
            failed = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
            after_error = (await c.get("/v1/appliance/requests")).json()
            return during, done, after, failed, after_error

    try:
        during, done, after, failed, after_error = asyncio.run(scenario())
    finally:
        log.close()
    (held,) = during["data"]
    assert held["id"] == "held-1" and held["class"] == "silver" and held["stream"] is True
    assert held["phase"] == "streaming" and held["chunks_from_engine"] == 1 and held["chunks_to_client"] == 1
    assert held["since_engine_s"] >= 0 and held["age_s"] >= held["since_client_s"] >= 0
    assert during["engine_local_in_flight"] == 1
    assert done.status_code == 200 and '"text":"b"' in done.text
    # the finished stream is recorded as answered (200), with its time to first token
    assert gw.metrics.requests.labels("/v1/completions", "200", "silver")._value.get() == 1
    assert gw.metrics.ttft.labels("/v1/completions", "silver")._sum.get() > 0
    assert after["data"] == [] and after["engine_local_in_flight"] == 0
    assert failed.status_code == 500 and after_error["data"] == []


def test_the_class_sets_the_engines_priority_whatever_the_client_sent(tmp_path):
    """vLLM's priority scheduling orders its queue and picks whom to preempt by the request's `priority`
    (lower first): the gateway sets it from the key's class, and a client cannot raise its own."""
    from appliance.api.admission import AdmissionConfig, AdmissionGate, ClassPolicy
    from appliance.store import keys

    seen: list[object] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content).get("priority"))
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok"}]})

    gate = AdmissionGate(AdmissionConfig(4, {c: ClassPolicy(5.0, None, 8) for c in ("gold", "silver", "bronze")}))
    made = serving(tmp_path, engine, admission=gate)
    gold = keys.create(made.cfg.database_path, "g", priority_class="gold")[1]
    bronze = keys.create(made.cfg.database_path, "b", priority_class="bronze")[1]
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "priority": -100}
    try:
        answers = [call(made.app, "POST", "/v1/completions", key, json=body) for key in (gold, None, bronze)]
    finally:
        made.log.close()
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert seen == [0, 1, 2]  # gold, silver (no key), bronze
    # admission's expectation goes with the answer, to be checked against the first token's arrival
    assert all(int(r.headers["x-appliance-predicted-ttft-ms"]) >= 0 for r in answers)


def test_the_class_token_limit_applies_when_max_tokens_is_left_out_or_null(tmp_path):
    """Issue 15: bronze with a 16-token limit generated 2,012 tokens by not naming max_tokens. The engine
    is told the class limit; an explicit value over it is refused, one under it is kept."""
    from appliance.api.admission import AdmissionConfig, AdmissionGate, ClassPolicy
    from appliance.store import keys

    seen: list[object] = []

    def engine(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        seen.append((sent.get("max_tokens"), sent.get("max_completion_tokens")))
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok"}]})

    gate = AdmissionGate(AdmissionConfig(4, {"gold": ClassPolicy(5.0, None, 8), "silver": ClassPolicy(5.0, None, 8),
                                             "bronze": ClassPolicy(5.0, 16, 8)}))
    made = serving(tmp_path, engine, admission=gate)
    bronze = keys.create(made.cfg.database_path, "b", priority_class="bronze")[1]
    gold = keys.create(made.cfg.database_path, "g", priority_class="gold")[1]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    try:
        statuses = [call(made.app, "POST", "/v1/completions", bronze, json={"model": "m", "prompt": "hi"}),
                    call(made.app, "POST", "/v1/chat/completions", bronze, json={**chat, "max_tokens": None}),
                    call(made.app, "POST", "/v1/chat/completions", bronze, json={**chat, "max_completion_tokens": None}),
                    call(made.app, "POST", "/v1/completions", bronze, json={"model": "m", "prompt": "hi", "max_tokens": 8}),
                    call(made.app, "POST", "/v1/completions", gold, json={"model": "m", "prompt": "hi"}),
                    # the fuzz suite's find: completions has no max_completion_tokens (vLLM ignores it there),
                    # so it neither stands in for max_tokens nor, being any JSON value, breaks the gateway
                    call(made.app, "POST", "/v1/completions", bronze, json={"model": "m", "prompt": "hi",
                                                                            "max_completion_tokens": 3}),
                    call(made.app, "POST", "/v1/completions", bronze, json={"model": "m", "prompt": "hi",
                                                                            "max_completion_tokens": "x"}),
                    call(made.app, "POST", "/v1/completions", bronze, json={"model": "m", "prompt": "hi", "max_tokens": 17})]
    finally:
        made.log.close()
    assert [r.status_code for r in statuses] == [200, 200, 200, 200, 200, 200, 200, 400], [r.text for r in statuses]
    assert statuses[-1].json()["error"]["code"] == "max_tokens_over_class_limit"
    assert seen == [(16, None), (16, None), (16, None), (8, None), (None, None),  # gold has no limit
                    (16, 3), (16, "x")]


def test_n_and_best_of_are_bounded_by_max_choices(tmp_path):

    seen: list[object] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content).get("n"))
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok"}]})

    made = serving(tmp_path, engine)
    base = {"model": "m", "prompt": "hi", "max_tokens": 1}
    try:
        ok = call(made.app, "POST", "/v1/completions", json={**base, "n": 4})
        wide = call(made.app, "POST", "/v1/completions", json={**base, "n": 4000})
        best = call(made.app, "POST", "/v1/completions", json={**base, "best_of": 5})
        odd = call(made.app, "POST", "/v1/completions", json={**base, "best_of": "5"})
        odd_n = call(made.app, "POST", "/v1/completions", json={**base, "n": "5"})
    finally:
        made.log.close()
    assert ok.status_code == 200 and seen == [4]
    assert (wide.status_code, wide.json()["error"]["code"], wide.json()["error"]["param"]) == (400, "too_many_choices", "n")
    assert (best.status_code, best.json()["error"]["param"]) == (400, "best_of")
    # a string is a type error for either field, answered the same way
    assert (odd.status_code, odd.json()["error"]["param"], odd.json()["error"]["code"]) == (422, "best_of", "invalid_type")
    assert (odd_n.status_code, odd_n.json()["error"]["param"], odd_n.json()["error"]["code"]) == (422, "n", "invalid_type")
