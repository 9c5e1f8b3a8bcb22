"""While the engine restarts, a new request waits for it (bounded per class, and in number) rather than
getting 503 at once: the real app in-process, a scripted engine on the engine's socket, the supervisor's
state moved by the test as a death and a restart would move it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import replace

import httpx

from appliance.engine.supervisor import EngineState
from appliance.store.requests import recent_requests
from tests.unit.appliance.api.inprocess import InProcess, serving

BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


def _engine(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"id": "c", "object": "text_completion", "model": "m",
                                     "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})


def _made(tmp_path, hold_s: float = 30.0, hold_max: int = 8, **per_class: float) -> InProcess:
    made = serving(tmp_path, _engine)
    made.gateway.settings = replace(made.gateway.settings, restart_hold_s=hold_s, restart_hold_max=hold_max,
                                    class_restart_hold_s=per_class)
    return made


async def _held(made: InProcess, c: httpx.AsyncClient, n: int = 1) -> None:
    """Until n requests wait for the engine (and the in-flight view says they are held)."""
    for _ in range(500):
        if made.gateway.held == n:
            phases = [r["phase"] for r in (await c.get("/v1/appliance/requests")).json()["data"]]
            assert phases == ["held"] * n, phases
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{made.gateway.held} held, not {n}")


def _holds(made: InProcess) -> dict[str, float]:
    text = made.gateway.metrics.render().decode()
    return {o: float(v) for o, v in re.findall(r'^appliance_restart_holds_total\{class="silver",outcome="(\w+)"\} (\S+)$',
                                                 text, re.M)}


def test_a_request_is_held_while_the_engine_restarts_and_answered_once_it_is_back(tmp_path):
    made = _made(tmp_path)
    sup = made.gateway.supervisor

    async def scenario() -> httpx.Response:
        await sup._set(EngineState.RESTARTING, "engine died (SIGKILL); restarting in 1s")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            sent = asyncio.create_task(c.post("/v1/completions", json=BODY))
            await _held(made, c)
            await sup._set(EngineState.READY, "serving")
            return await sent

    try:
        r = asyncio.run(scenario())
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
        assert _holds(made) == {"served": 1.0} and made.gateway.held == 0
    finally:
        made.log.close()
    assert [row["status"] for row in recent_requests(made.cfg.database_path)] == [200]  # recorded once


def test_the_class_bound_ends_the_hold_with_the_engines_503(tmp_path):
    made = _made(tmp_path, hold_s=30.0, silver=0.3)  # silver's own bound, not the server's

    async def scenario() -> tuple[httpx.Response, float]:
        await made.gateway.supervisor._set(EngineState.RESTARTING, "engine died; restarting in 1s")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            t = time.monotonic()
            r = await c.post("/v1/completions", json=BODY)
            return r, time.monotonic() - t

    try:
        r, took = asyncio.run(scenario())
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_not_ready", r.text
        assert r.headers["retry-after"] == "3" and 0.3 <= took < 10, took
        assert _holds(made) == {"timed_out": 1.0}
    finally:
        made.log.close()


def test_a_supervisor_giving_up_ends_the_hold_at_once(tmp_path):
    made = _made(tmp_path, hold_s=30.0)
    sup = made.gateway.supervisor

    async def scenario() -> tuple[httpx.Response, float]:
        await sup._set(EngineState.RESTARTING, "engine died; restarting in 1s")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            sent = asyncio.create_task(c.post("/v1/completions", json=BODY))
            await _held(made, c)
            t = time.monotonic()
            await sup._set(EngineState.FAILED, "engine failed 5 times within 300s; giving up")
            return await sent, time.monotonic() - t

    try:
        r, took = asyncio.run(scenario())
        assert r.status_code == 503 and "giving up" in r.json()["error"]["message"] and took < 5, (r.text, took)
        assert _holds(made) == {"gave_up": 1.0}
    finally:
        made.log.close()


def test_no_hold_at_a_first_start_with_a_bound_of_zero_or_past_the_number_held(tmp_path):
    made = _made(tmp_path, hold_s=30.0, hold_max=1)
    sup = made.gateway.supervisor

    async def scenario() -> list[int]:
        statuses = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            await sup._set(EngineState.STARTING, "loading model")  # a first start: its length is the model's load
            statuses.append((await c.post("/v1/completions", json=BODY)).status_code)
            await sup._set(EngineState.RESTARTING, "engine died; restarting in 1s")
            first = asyncio.create_task(c.post("/v1/completions", json=BODY))
            await _held(made, c)
            statuses.append((await c.post("/v1/completions", json=BODY)).status_code)  # one held already: full
            made.gateway.settings = replace(made.gateway.settings, restart_hold_s=0.0)
            statuses.append((await c.post("/v1/completions", json=BODY)).status_code)  # holding turned off
            await sup._set(EngineState.READY, "serving")
            statuses.append((await first).status_code)
        return statuses

    try:
        assert asyncio.run(scenario()) == [503, 503, 503, 200]
        assert _holds(made) == {"full": 1.0, "served": 1.0}
    finally:
        made.log.close()


def test_a_client_leaving_while_held_gives_its_place_up(tmp_path):
    made = _made(tmp_path, hold_s=30.0)
    sup = made.gateway.supervisor

    async def scenario() -> list[dict]:
        """The app called as the server calls it, so the client's going is an ASGI http.disconnect."""
        await sup._set(EngineState.RESTARTING, "engine died; restarting in 1s")
        inbox: asyncio.Queue[dict] = asyncio.Queue()
        await inbox.put({"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False})
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"t"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 40000), "server": ("t", 80)}
        call = asyncio.create_task(made.app(scope, inbox.get, send))
        for _ in range(500):
            if made.gateway.held == 1:
                break
            await asyncio.sleep(0.01)
        assert made.gateway.held == 1
        await inbox.put({"type": "http.disconnect"})
        await asyncio.wait_for(call, 10)
        return sent

    try:
        asyncio.run(scenario())
        assert made.gateway.held == 0 and _holds(made) == {"left": 1.0}
    finally:
        made.log.close()
    assert [row["status"] for row in recent_requests(made.cfg.database_path)] == [499]


def test_a_request_the_dead_engine_refused_before_the_supervisor_knew_is_held_too(tmp_path):
    """The engine's socket refuses a connection while the supervisor still says ready (it has not seen the
    exit yet): nothing was sent, so the request waits for the supervisor to notice, is held through the
    restart, and is sent again once."""
    made = _made(tmp_path)
    sup = made.gateway.supervisor
    sock = made.gateway.settings.engine_socket
    assert sock is not None
    hidden = sock.with_name("hidden.sock")

    async def scenario() -> httpx.Response:
        sock.rename(hidden)  # the engine is gone: connections are refused
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            sent = asyncio.create_task(c.post("/v1/completions", json=BODY))
            await asyncio.sleep(0.3)
            assert not sent.done() and made.gateway.held == 0  # waiting for the supervisor to notice
            await sup._set(EngineState.RESTARTING, "engine died (SIGKILL); restarting in 1s")
            await _held(made, c)
            hidden.rename(sock)  # the restarted engine listens
            await sup._set(EngineState.READY, "serving")
            return await sent

    try:
        r = asyncio.run(scenario())
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
        assert _holds(made) == {"served": 1.0}
    finally:
        made.log.close()
    assert [row["status"] for row in recent_requests(made.cfg.database_path)] == [200]


def test_an_upgrade_in_place_holds_for_the_longer_upgrade_bound(tmp_path):
    """A planned swap (the supervisor on trial) loads and gates the new engine: its own, longer bound
    applies, not the class's restart bound."""
    made = _made(tmp_path, hold_s=30.0, silver=0.3)
    made.gateway.settings = replace(made.gateway.settings, upgrade_hold_s=60.0)
    sup = made.gateway.supervisor

    async def scenario() -> httpx.Response:
        await sup._set(EngineState.RESTARTING, "relaunching: upgrade to /m/new")
        sup._trial = object()  # type: ignore[assignment]  # on trial, as try_launch leaves it
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            sent = asyncio.create_task(c.post("/v1/completions", json=BODY))
            await _held(made, c)
            await asyncio.sleep(0.6)  # past silver's own 0.3 s: still held
            assert made.gateway.held == 1 and not sent.done()
            await sup._set(EngineState.READY, "serving")
            return await sent

    try:
        r = asyncio.run(scenario())
        assert r.status_code == 200 and _holds(made) == {"served": 1.0}
    finally:
        made.log.close()


def test_a_request_the_dying_engine_closed_without_answering_is_held_and_sent_again(tmp_path):
    """The engine took the connection and died before a byte of answer (SIGKILL with requests in its
    socket's queue): the same as a refused connection. Measured before this: 503 at once, in CI."""
    calls: list[int] = []

    def dies_first(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError("the engine died")  # the stand-in closes without answering
        return _engine(request)

    made = serving(tmp_path, dies_first)
    made.gateway.settings = replace(made.gateway.settings, restart_hold_s=30.0, restart_hold_max=8)
    sup = made.gateway.supervisor

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            sent = asyncio.create_task(c.post("/v1/completions", json=BODY))
            for _ in range(200):
                if calls:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert not sent.done(), (await sent).text
            await sup._set(EngineState.RESTARTING, "engine died (SIGKILL); restarting in 1s")
            await _held(made, c)
            await sup._set(EngineState.READY, "serving")
            return await sent

    try:
        r = asyncio.run(scenario())
        assert r.status_code == 200 and len(calls) == 2, r.text
    finally:
        made.log.close()
