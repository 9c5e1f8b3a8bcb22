"""/metrics: the gateway's own figures (the engine's re-exported figures are checked in the integration tests)."""

from __future__ import annotations

import asyncio

import httpx

from appliance.engine.supervisor import EngineState, EngineStatus
from appliance.engine.watch import EngineWatch
from appliance.ops.metrics import Metrics
from appliance.store import keys
from appliance.store.requests import RequestRecord
from tests.unit.appliance.api.inprocess import app, call, serving

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _value(text: str, sample: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(sample + " "))
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


# As vLLM writes it (prometheus-client's text format: a counter's HELP and TYPE carry _total).
ENGINE_TEXT = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.\n"
    "# TYPE vllm:e2e_request_latency_seconds histogram\n"
    'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 7.0\n'
    'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 7.0\n'
    "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n"
    "# TYPE vllm:prefix_cache_queries_total counter\n"
    'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 40.0\n'
)


def test_engine_figures_come_from_the_watchs_last_text():
    m = Metrics()
    text: list[str | None] = [ENGINE_TEXT]
    m.attach_engine(lambda: text[0])
    out = m.render().decode()
    assert _value(out, 'vllm:num_requests_running{engine="0",model_name="m"}') == 2
    assert _value(out, 'vllm:kv_cache_usage_perc{engine="0",model_name="m"}') == 0.25
    assert _value(out, 'vllm:prefix_cache_queries_total{engine="0",model_name="m"}') == 40
    assert "e2e_request_latency" not in out  # not a dashboard family
    text[0] = None  # the last poll failed: no stale engine figures
    assert "vllm:" not in m.render().decode()
    text[0] = "vllm:num_requests_running{ 1\n"  # garbage from the engine fails no scrape
    assert "appliance_requests" in m.render().decode()


def test_a_scrape_never_calls_the_engine(tmp_path):
    """GET /metrics answers from the engine watch's last poll, whatever the engine is doing now."""
    calls: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, text=ENGINE_TEXT)

    # An engine that answers, on the gateway's own client: a scrape that still called it would be seen.
    made = serving(tmp_path, engine)
    application, log, gw = made.app, made.log, made.gateway
    watch = EngineWatch(gw.client, lambda: gw.supervisor.base_url,
                        on_error=gw.metrics.engine_scrape_errors.inc)
    gw.metrics.attach_engine(lambda: watch.latest_text)
    try:
        asyncio.run(watch.poll_once())
        assert calls == ["/metrics"]
        text = call(application, "GET", "/metrics").text
        assert calls == ["/metrics"]  # the scrape itself did not reach the engine
        assert _value(text, 'vllm:num_requests_running{engine="0",model_name="m"}') == 2
    finally:
        log.close()


def test_a_failed_poll_is_counted_and_forgets_the_last_text():
    answers = iter([httpx.Response(200, text=ENGINE_TEXT), httpx.Response(503, text="loading")])
    m = Metrics()

    async def scenario() -> list[str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: next(answers))) as client:
            watch = EngineWatch(client, lambda: "http://engine", on_error=m.engine_scrape_errors.inc)
            seen = []
            for _ in range(2):
                await watch.poll_once()
                seen.append(watch.latest_text)
            return seen

    assert asyncio.run(scenario()) == [ENGINE_TEXT, None]
    assert _value(m.render().decode(), "appliance_engine_scrape_errors_total") == 1
