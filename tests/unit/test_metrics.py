"""/metrics: the gateway's own figures (the engine's re-exported figures are checked in the integration tests)."""

from __future__ import annotations

from appliance import keys
from appliance.engine.supervisor import EngineState, EngineStatus
from appliance.metrics import Metrics
from appliance.store import RequestRecord
from tests.unit.inprocess import app, call

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _value(text: str, sample: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(sample + " "))
    return float(line.rsplit(" ", 1)[1])


def test_requests_counted_by_route_status_and_class(tmp_path):
    cfg, application, log = app(tmp_path, required=True)
    _, gold = keys.create(cfg.database_path, "a", priority_class="gold")
    try:
        call(application, "POST", "/v1/chat/completions", key=gold, json=CHAT)  # 503: engine not started
        call(application, "POST", "/v1/chat/completions", key=gold, json={"model": "other", "messages": []})
        assert call(application, "GET", "/metrics").status_code == 401  # a key is needed here too
        text = call(application, "GET", "/metrics", key=gold).text
    finally:
        log.close()
    assert _value(text, 'appliance_requests_total{class="gold",route="/v1/chat/completions",status="503"}') == 1
    assert _value(text, 'appliance_requests_total{class="gold",route="/v1/chat/completions",status="422"}') == 1
    assert _value(text, 'appliance_engine_state{state="stopped"}') == 1
    assert "vllm:" not in text  # no engine to scrape


def test_streamed_latencies_and_restarts():
    m = Metrics()
    rec = RequestRecord(id="r", ts=0, route="/v1/completions", model="m", status=200, stream=True,
                        completion_tokens=11, ttft_ms=100.0, total_ms=600.0)
    m.observe_request(rec, "silver")
    m.observe_engine(EngineStatus(state=EngineState.RESTARTING, restarts=2))
    text = m.render().decode()
    assert _value(text, 'appliance_time_to_first_token_seconds_count{class="silver",route="/v1/completions"}') == 1
    assert _value(text, 'appliance_time_to_first_token_seconds_sum{class="silver",route="/v1/completions"}') == 0.1
    # (600 - 100) ms over the 10 tokens after the first
    assert _value(text, 'appliance_time_per_output_token_seconds_sum{class="silver",route="/v1/completions"}') == 0.05
    assert _value(text, "appliance_engine_restarts_total") == 2
    assert _value(text, 'appliance_engine_state{state="restarting"}') == 1
