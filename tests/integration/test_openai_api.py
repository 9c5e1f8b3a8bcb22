"""The official openai client against the real appliance and the real vLLM CPU engine."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests import loopback
from tests.support import RunningAppliance, send_raw, state_dump, wait_for

pytestmark = pytest.mark.engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ERROR_KEYS = {"message", "type", "param", "code"}


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def _running(appliance: RunningAppliance) -> float:
    text = appliance.engine_get("/metrics", timeout=5).text
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert m, "engine exports vllm:num_requests_running"
    return float(m.group(1))


def test_health_and_readiness(appliance: RunningAppliance):
    assert loopback.get(f"{appliance.url}/healthz").json()["status"] == "alive"
    r = loopback.get(f"{appliance.url}/readyz")
    assert r.status_code == 200 and r.json()["engine"]["state"] == "ready"


def test_models_lists_the_served_model(oai: openai.OpenAI, appliance: RunningAppliance):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [appliance.served_name]


def test_chat_completion(oai: openai.OpenAI, appliance: RunningAppliance):
    r = oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip()
    assert r.usage.prompt_tokens > 5 and 1 <= r.usage.completion_tokens <= 8
    assert r.choices[0].logprobs is None  # not asked for, not returned


def test_completion(oai: openai.OpenAI, appliance: RunningAppliance):
    r = oai.completions.create(model=appliance.served_name, prompt="The capital of France is", max_tokens=4,
                               temperature=0)
    assert r.choices[0].text.strip()
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"


def test_chat_stream_without_usage_hides_the_usage_event(oai: openai.OpenAI, appliance: RunningAppliance):
    chunks = list(oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=8,
                                              temperature=0, stream=True))
    assert len(chunks) >= 3
    assert all(c.usage is None for c in chunks), "the appliance asked vLLM for usage itself; the client did not"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


def test_chat_stream_with_usage(oai: openai.OpenAI, appliance: RunningAppliance):
    chunks = list(oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=6,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == sum(1 for c in chunks if c.choices and c.choices[0].delta.content)


def test_completion_stream(oai: openai.OpenAI, appliance: RunningAppliance):
    chunks = list(oai.completions.create(model=appliance.served_name, prompt="Once upon a time", max_tokens=5,
                                         temperature=0, stream=True))
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 1


def test_stream_is_relayed_incrementally_not_buffered(appliance: RunningAppliance):
    body = {"model": appliance.served_name, "prompt": "Count:", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    t0 = time.perf_counter()
    with loopback.stream("POST", f"{appliance.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - t0)
    assert len(arrivals) >= 40
    # Buffered relaying would deliver every event at the end; relayed events spread over the generation.
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals[:3] + arrivals[-3:]


def test_chat_logprobs(oai: openai.OpenAI, appliance: RunningAppliance):
    r = oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        # greedy decoding picks a token with the top log-probability
        assert tok.logprob >= max(t.logprob for t in tok.top_logprobs) - 1e-6


def test_completion_logprobs_streamed(oai: openai.OpenAI, appliance: RunningAppliance):
    chunks = list(oai.completions.create(model=appliance.served_name, prompt="Paris is the capital of",
                                         max_tokens=3, temperature=0, logprobs=2, stream=True))
    with_lp = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert with_lp and all(len(c.choices[0].logprobs.top_logprobs[0]) >= 1 for c in with_lp)


def test_chat_logprobs_streamed(oai: openai.OpenAI, appliance: RunningAppliance):
    chunks = list(oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) >= 1 and all(len(t.top_logprobs) == 2 for t in tokens)


# -- bad input ------------------------------------------------------------------------------


def test_malformed_json_is_400(appliance: RunningAppliance):
    r = loopback.post(f"{appliance.url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert _error(r)["code"] == "invalid_json"


def test_json_that_is_not_an_object_is_400(appliance: RunningAppliance):
    r = loopback.post(f"{appliance.url}/v1/completions", json=[1, 2])
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"model": 7}, "model"),
        ({"top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_wrong_types_are_422_naming_the_param(appliance: RunningAppliance, patch: dict, param: str):
    body = {"model": appliance.served_name, "messages": QUESTION, **patch}
    r = loopback.post(f"{appliance.url}/v1/chat/completions", json=body)
    assert r.status_code == 422
    err = _error(r)
    assert err["param"].startswith(param) and err["type"] == "invalid_request_error"


def test_unknown_model_is_404(oai: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="gpt-nonexistent", messages=QUESTION, max_tokens=2)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"


def test_body_over_limit_is_413(appliance: RunningAppliance):
    big = {"model": appliance.served_name, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = loopback.post(f"{appliance.url}/v1/chat/completions", json=big)
    assert r.status_code == 413 and _error(r)["code"] == "body_too_large"


def test_body_over_limit_without_content_length_is_413(appliance: RunningAppliance):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    r = loopback.post(f"{appliance.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and _error(r)["code"] == "body_too_large"


def test_engine_rejection_keeps_status_and_gets_openai_shape(oai: openai.OpenAI, appliance: RunningAppliance):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=99999)
    err = exc.value.body
    assert set(err) == ERROR_KEYS
    assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens"
    assert "max_model_len" in err["message"]


def test_unknown_route_and_wrong_method(appliance: RunningAppliance):
    r = loopback.get(f"{appliance.url}/v1/nothing-here")
    assert r.status_code == 404 and _error(r)["code"] == "not_found"
    r = loopback.delete(f"{appliance.url}/v1/models")
    assert r.status_code == 405 and _error(r)["code"] == "method_not_allowed"


# -- disconnects abort the upstream request ---------------------------------------------------


def _long_request(appliance: RunningAppliance, stream: bool) -> dict:
    return {"model": appliance.served_name, "prompt": "Tell a very long story.", "max_tokens": 1800,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def test_stream_client_disconnect_aborts_engine_request(appliance: RunningAppliance):
    wait_for(lambda: _running(appliance) == 0, 30, what="an idle engine")
    with loopback.stream("POST", f"{appliance.url}/v1/completions", json=_long_request(appliance, True), timeout=60) as r:
        lines = r.iter_lines()  # kept referenced: a collected iterator closes the stream (a disconnect)
        assert next(line for line in lines if line.startswith("data: {"))
        # the gauge follows the engine's steps; give it a moment to show the request
        wait_for(lambda: _running(appliance) == 1, 10, what="the engine to report the request running")
    # 1800 tokens take far longer than this on the CPU engine: only an abort empties it this fast.
    wait_for(lambda: _running(appliance) == 0, 15, what="vLLM to abort the request")


def test_nonstream_client_disconnect_aborts_engine_request(appliance: RunningAppliance):
    wait_for(lambda: _running(appliance) == 0, 30, what="an idle engine")
    # A raw socket, so the test decides when the client goes away: only once the engine shows the
    # request running (a read timeout raced the engine's first step on a slow CI box).
    with send_raw(appliance.port, "/v1/completions", _long_request(appliance, False)):
        wait_for(lambda: _running(appliance) == 1, 30, what="the engine to report the request running")
    wait_for(lambda: _running(appliance) == 0, 15, what="vLLM to abort the request")


# -- request log -------------------------------------------------------------------------------


def _rows(appliance: RunningAppliance) -> list[dict]:
    db = appliance.config.parent / "state" / "appliance.db"
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("select * from requests")]
    finally:
        con.close()


def test_request_log_has_one_row_per_request_without_text(appliance: RunningAppliance):
    rid = "req-logtest-" + str(time.time_ns())
    r = loopback.post(f"{appliance.url}/v1/chat/completions", headers={"X-Request-Id": rid},
                      json={"model": appliance.served_name, "messages": QUESTION, "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    bad = loopback.post(f"{appliance.url}/v1/chat/completions", headers={"X-Request-Id": rid + "-bad"},
                        json={"model": "nope", "messages": QUESTION})
    assert bad.status_code == 404

    rows = wait_for(lambda: {r["id"]: r for r in _rows(appliance) if r["id"].startswith(rid)} or None, 10,
                    what="request-log rows")
    wait_for(lambda: len({r["id"] for r in _rows(appliance) if r["id"].startswith(rid)}) == 2, 10, what="both rows")
    rows = {r["id"]: r for r in _rows(appliance) if r["id"].startswith(rid)}
    ok = rows[rid]
    assert ok["status"] == 200 and ok["stream"] == 1 and ok["model"] == appliance.served_name
    assert ok["prompt_tokens"] > 5 and 1 <= ok["completion_tokens"] <= 4
    assert 0 < ok["ttft_ms"] <= ok["total_ms"]
    assert ok["prompt"] is None and ok["completion"] is None, "no text unless the configuration asks"
    rejected = rows[rid + "-bad"]
    assert rejected["status"] == 404 and rejected["error_code"] == "model_not_found"
    assert "capital of France" not in json.dumps(list(rows.values()))


def test_metrics_have_gateway_latencies_and_engine_figures(oai: openai.OpenAI, appliance: RunningAppliance):
    list(oai.chat.completions.create(model=appliance.served_name, messages=QUESTION, max_tokens=4, stream=True))
    text = loopback.get(f"{appliance.url}/metrics").text
    ttft = re.search(r'^appliance_time_to_first_token_seconds_count\{class="silver",route="/v1/chat/completions"\} (\S+)$',
                     text, re.M)
    assert ttft and float(ttft.group(1)) >= 1
    assert re.search(r'^appliance_engine_state\{state="ready"\} 1\.0$', text, re.M)
    # the engine's own figures, re-exported from its private port
    assert re.search(r"^vllm:kv_cache_usage_perc\{.*\} \S+$", text, re.M)
    assert re.search(r"^vllm:prefix_cache_queries_total\{.*\} \S+$", text, re.M)


def test_status_and_metrics_carry_the_model_digest(appliance: RunningAppliance):
    from kernels.manifest import build

    status = loopback.get(f"{appliance.url}/v1/appliance/status").json()
    digest = build(Path(status["model"]["path"])).digest
    assert status["model"]["digest"] == digest and status["engine"]["state"] == "ready"
    assert status["plan"]["max_model_len"] == 2048
    metrics = loopback.get(f"{appliance.url}/metrics").text
    assert f'digest="{digest}"' in metrics


def test_a_held_stream_shows_in_the_requests_in_flight_and_in_the_state_dump(appliance: RunningAppliance):
    """GET /v1/appliance/requests and SIGUSR1: what an operator looks at when a client says it hangs."""
    body = {**_long_request(appliance, True), "prompt": "Write about the sea."}

    def mine() -> list[dict]:
        listed = loopback.get(f"{appliance.url}/v1/appliance/requests", timeout=30).json()["data"]
        return [q for q in listed if q["id"] == "held-for-the-dump"]

    with loopback.stream("POST", f"{appliance.url}/v1/completions", json=body, timeout=60,
                         headers={"X-Request-Id": "held-for-the-dump"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        (held,) = mine()
        assert held["phase"] == "streaming" and held["stream"] is True and held["class"] == "silver"
        assert held["chunks_from_engine"] >= 1 and held["chunks_to_client"] >= 1
        dump = state_dump(appliance, timeout=30)
    assert dump is not None, "no state dump in the log 30 s after SIGUSR1"
    assert '"id": "held-for-the-dump"' in dump and '"phase": "streaming"' in dump
    assert "task api: " in dump and "task loop-monitor: " in dump  # every task, by name, with its stack
    assert appliance.proc.poll() is None  # SIGUSR1 asks; it does not stop the daemon
    wait_for(lambda: not mine(), 30, what="the closed stream to leave the requests in flight")


def test_models_retrieve_through_the_sdk(oai: openai.OpenAI, appliance: RunningAppliance):
    """The SDK's models.retrieve: vLLM 0.32 has no GET /v1/models/{id} (404 straight from the engine), the
    appliance answers it with the engine's own entry."""
    model = oai.models.retrieve(appliance.served_name)
    listed = {m.id: m for m in oai.models.list().data}
    # vLLM makes `created` and the permission entry's id afresh at each call: the rest is the model's
    same = lambda m: m.model_dump(exclude={"created", "permission"})
    assert model.id == appliance.served_name and same(model) == same(listed[appliance.served_name])
    from appliance.boot import config

    key = (config.load(appliance.config).state.directory / "engine.key").read_text().strip()
    straight = appliance.engine_get(f"/v1/models/{appliance.served_name}", timeout=5,
                                    headers={"Authorization": f"Bearer {key}"})
    assert straight.status_code == 404  # the engine itself has no such route
    assert appliance.engine_get("/v1/models", timeout=5, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


# -- the Responses and Messages APIs, side by side with the engine ----------------------------------------


def _engine_key(appliance: RunningAppliance) -> str:
    from appliance.boot import config

    return (config.load(appliance.config).state.directory / "engine.key").read_text().strip()


def _straight_oai(appliance: RunningAppliance) -> openai.OpenAI:
    """The same SDK pointed straight at the engine's socket, with the engine's key."""
    from appliance.engine.args import ENGINE_BASE_URL

    return openai.OpenAI(base_url=f"{ENGINE_BASE_URL}/v1", api_key=_engine_key(appliance), max_retries=0, timeout=120,
                         http_client=loopback.unix_client(str(appliance.engine_socket)))


def _log_rows(appliance: RunningAppliance, route: str, since: float) -> list[dict]:
    return [r for r in _rows(appliance) if r["route"] == route and r["ts"] >= since]


def test_the_responses_api_answers_as_the_engine_does(oai: openai.OpenAI, appliance: RunningAppliance):
    """responses.create plain and streamed, through the appliance and straight to the engine: greedy, so the
    same text; through the appliance each is a request-log row with its tokens."""
    since = time.time()
    ask = {"model": appliance.served_name, "input": "What is the capital of France?", "max_output_tokens": 8,
           "temperature": 0}
    texts, streamed = [], []
    for client in (oai, _straight_oai(appliance)):
        r = client.responses.create(**ask)
        assert r.status == "completed" and r.usage.output_tokens <= 8
        texts.append(r.output_text)
        with client.responses.stream(**ask) as s:
            deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
            final = s.get_final_response()
        assert "".join(deltas) == final.output_text
        streamed.append(final.output_text)
    assert texts[0] == texts[1] and texts[0].strip(), texts
    assert streamed[0] == streamed[1] == texts[0]
    rows = wait_for(lambda: len(_log_rows(appliance, "/v1/responses", since)) == 2 and
                    _log_rows(appliance, "/v1/responses", since), 10, what="two request-log rows")
    assert {(r["status"], r["stream"]) for r in rows} == {(200, 0), (200, 1)}
    assert all(r["prompt_tokens"] > 5 and 1 <= r["completion_tokens"] <= 8 for r in rows), rows
    with pytest.raises(openai.NotFoundError):  # nothing is stored (docs/http-api.md)
        oai.responses.retrieve(final.id)


def test_anthropic_messages_answer_as_the_engine_does(appliance: RunningAppliance):
    """The anthropic package's messages.create, plain and streamed, and count_tokens: through the appliance
    (its key as x-api-key, as the SDK sends it) and straight to the engine (which wants a Bearer key)."""
    import anthropic

    from appliance.engine.args import ENGINE_BASE_URL

    key = _engine_key(appliance)
    through = anthropic.Anthropic(base_url=appliance.url, api_key="unused-on-loopback", max_retries=0, timeout=120,
                                  http_client=loopback.anthropic_http_client())
    straight = anthropic.Anthropic(base_url=ENGINE_BASE_URL, api_key=key, max_retries=0, timeout=120,
                                   default_headers={"Authorization": f"Bearer {key}"},
                                   http_client=loopback.anthropic_http_client(str(appliance.engine_socket)))
    # greedy, so both answer alike (this SDK version has no temperature parameter: sent in the body)
    ask = {"model": appliance.served_name, "max_tokens": 8, "extra_body": {"temperature": 0},
           "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    answers, streamed, counted = [], [], []
    for client in (through, straight):
        m = client.messages.create(**ask)
        assert m.type == "message" and m.usage.output_tokens <= 8
        answers.append(m.content[0].text)
        with client.messages.stream(**ask) as s:
            text = "".join(s.text_stream)
            streamed.append((text, s.get_final_message().usage.output_tokens))
        counted.append(client.messages.count_tokens(model=ask["model"], messages=ask["messages"]).input_tokens)
    assert answers[0] == answers[1] and answers[0].strip(), answers
    assert streamed[0] == streamed[1] and streamed[0][0] == answers[0]
    assert counted[0] == counted[1] > 5
    with pytest.raises(anthropic.NotFoundError) as e:
        through.messages.create(**{**ask, "model": "no-such-model"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"


def test_the_route_table_names_every_route_the_engine_serves(appliance: RunningAppliance):
    """docs/http-api.md's table against the engine's own OpenAPI document: a route a new vLLM adds, or one
    it drops, fails here until the table says what the appliance does with it."""
    from tests.unit.project.test_engine_route_table import engine_route_table

    spec = appliance.engine_get("/openapi.json", timeout=10,
                                headers={"Authorization": f"Bearer {_engine_key(appliance)}"}).json()
    engine = {(method.upper(), path) for path, methods in spec["paths"].items() for method in methods}
    table = set(engine_route_table())
    assert sorted(engine - table) == [] and sorted(table - engine) == []


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _weather_args(arguments: str) -> dict:
    """The arguments as the tool's schema asks: a JSON object with a string city (not a JSON string)."""
    args = json.loads(arguments)
    assert isinstance(args, dict) and isinstance(args.get("city"), str) and args["city"], arguments
    return args


def test_tool_calls_answer_as_the_engine_does_with_arguments_the_schema_allows(oai: openai.OpenAI,
                                                                               appliance: RunningAppliance):
    """The plan's tool parser on the real engine (the default model: named and required through structured
    output): a named choice, required, a named choice streamed (the SDK's deltas assembled), a function call
    through the Responses API, and the turn after a tool's result, through the appliance and straight to
    the engine. auto, which this model's template cannot serve, is refused through the appliance with what
    works, where the engine would silently answer as if no tools were given."""
    plan = loopback.get(f"{appliance.url}/v1/appliance/plan").json()
    assert plan["tools"]["tool_call_parser"] and plan["tools"]["auto_tool_choice"] is False
    named = {"type": "function", "function": {"name": "get_weather"}}
    seen: list[list] = []
    for client in (oai, _straight_oai(appliance)):
        calls = []
        for choice in (named, "required"):
            r = client.chat.completions.create(model=appliance.served_name, messages=ASK_WEATHER, tools=[WEATHER],
                                               tool_choice=choice, max_tokens=48, temperature=0)
            (call,) = r.choices[0].message.tool_calls
            calls.append((call.function.name, _weather_args(call.function.arguments)))
        args, names = "", set()
        for chunk in client.chat.completions.create(model=appliance.served_name, messages=ASK_WEATHER,
                                                    tools=[WEATHER], tool_choice=named, max_tokens=48,
                                                    temperature=0, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                args += d.function.arguments or "" if d.function else ""
                names |= {d.function.name} if d.function and d.function.name else set()
        calls.append((names, _weather_args(args)))
        r = client.responses.create(model=appliance.served_name, input="What is the weather in Paris?",
                                    tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required",
                                    max_output_tokens=48, temperature=0)
        (fc,) = [o for o in r.output if o.type == "function_call"]
        calls.append((fc.name, _weather_args(fc.arguments)))
        after = client.chat.completions.create(
            model=appliance.served_name, tools=[WEATHER], max_tokens=24, temperature=0, messages=[
                *ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
        calls.append(bool(after.choices[0].message.content.strip()))
        seen.append(calls)
    assert seen[0] == seen[1], seen
    assert seen[0][0][0] == seen[0][1][0] == seen[0][3][0] == "get_weather" and seen[0][2][0] == {"get_weather"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=appliance.served_name, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=8)
    assert e.value.body["code"] == "tool_choice_unsupported" and e.value.body["param"] == "tool_choice"
    straight = _straight_oai(appliance).chat.completions.create(model=appliance.served_name, messages=ASK_WEATHER,
                                                                tools=[WEATHER], max_tokens=8, temperature=0)
    assert not straight.choices[0].message.tool_calls  # what auto would have silently given
