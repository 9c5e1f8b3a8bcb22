"""A request's life ends in one place (appliance.api.exchange): however it ends, its exchange is closed
exactly once, which gives back its admission slot, takes it off the in-flight view and the engine's drain
count, and writes one metrics observation and one request-log row."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from unittest import mock

import httpx
import pytest

from appliance.api import exchange
from appliance.api.admission import AdmissionConfig, AdmissionGate, ClassPolicy
from appliance.api.dialects import COMPLETIONS
from tests.unit.appliance.api.inprocess import serving


def _engine(request: httpx.Request) -> httpx.Response:
    prompt = json.loads(request.content).get("prompt")
    if prompt == "refuse":
        return httpx.Response(400, json={"object": "error", "message": "bad", "type": "BadRequestError", "code": 400})
    if json.loads(request.content).get("stream"):
        async def events():
            yield b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            yield b"data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())
    return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok"}],
                                     "usage": {"prompt_tokens": 1, "completion_tokens": 1}})


CASES = {
    "answered": ({"model": "m", "prompt": "hi", "max_tokens": 1}, 200, None),
    "streamed": ({"model": "m", "prompt": "hi", "max_tokens": 1, "stream": True}, 200, None),
    "engine refused": ({"model": "m", "prompt": "refuse", "max_tokens": 1}, 400, "engine_rejected"),
    "bad body": ({"model": "m", "prompt": "hi", "max_tokens": "x"}, 422, "invalid_type"),
    "unknown model": ({"model": "other", "prompt": "hi"}, 404, "model_not_found"),
    "admission refused": ({"model": "m", "prompt": "hi", "max_tokens": 99}, 400, "max_tokens_over_class_limit"),
    "gateway fault": ({"model": "m", "prompt": "fault", "max_tokens": 1}, 500, "internal_error"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_ending_closes_the_exchange_once(tmp_path, case, monkeypatch):
    body, status, code = CASES[case]
    gate = AdmissionGate(AdmissionConfig(2, {"silver": ClassPolicy(5.0, 16, 4)}))
    made = serving(tmp_path, _engine, admission=gate)
    closed: Counter[str] = Counter()
    real = exchange.Exchanges.closed

    def count(self, ex):
        closed[ex.id] += 1
        real(self, ex)

    monkeypatch.setattr(exchange.Exchanges, "closed", count)
    if case == "gateway fault":
        real_hold = exchange.Exchange.hold

        def broken(self, ticket):
            real_hold(self, ticket)
            raise RuntimeError("a bug in the gateway")
        monkeypatch.setattr(exchange.Exchange, "hold", broken)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            return await c.post("/v1/completions", json=body, headers={"X-Request-Id": "one"})

    try:
        r = asyncio.run(go())
    finally:
        made.log.close()
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["error"]["code"] == code
    assert closed == {"one": 1}
    assert made.gateway.exchanges.snapshot() == [] and made.gateway.local_in_flight == 0
    assert gate.load().in_flight.get("silver", 0) == 0  # the slot went back
    assert made.gateway.metrics.requests.labels("/v1/completions", str(status), "silver")._value.get() == 1


def test_closing_twice_records_once():
    log = mock.Mock(keep_text=False)
    exchanges = exchange.Exchanges(log, None, None)
    ex = exchanges.open("r", COMPLETIONS, "silver", None)
    ex.hold(None)
    ex.close(200)
    ex.close(502, "engine_stream_broken")
    ex.release()
    assert log.record.call_count == 1 and ex.rec.status == 200 and exchanges.engine_answering == 0
