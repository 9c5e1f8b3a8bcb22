"""The spliced stream (appliance.api.splice) and the engine leg under it (appliance.api.engine_stream), on a
real uvicorn with the daemon's connection layer, against a scripted engine on a Unix socket: every way a
stream can end, as the client and the request log see it. The real engine streams through the same path
in tests/integration."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

from appliance.api import splice
from appliance.api.app import create_app
from appliance.api.gateway import Gateway, GatewaySettings
from appliance.api.http_protocol import GuardedHttpProtocol
from appliance.boot import config
from appliance.engine.args import build_launch
from appliance.engine.supervisor import EngineState, EngineSupervisor
from appliance.ops.metrics import Metrics
from appliance.store import keys
from appliance.store.requests import RequestLog
from cascade.service import Cascade
from tests import loopback
from tests.support import serve_in_thread, short_private_dir
from tests.unit.appliance.api.scripted_engine import Script, ScriptedEngine, send_chunk, send_end, send_head

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def event(i: int) -> bytes:
    return b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i


USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
         b'"usage":{"prompt_tokens":3,"completion_tokens":7,"total_tokens":10}}\n\n')
DONE = b"data: [DONE]\n\n"


@contextmanager
def gateway_on(tmp_path: Path, script: Script, timeout_s: float = 5.0,
               cascade: Cascade | None = None) -> Iterator[tuple[int, ScriptedEngine, Gateway, Path]]:
    """The daemon's app on uvicorn with the guarded connection layer, its engine `script` on a Unix socket."""
    cfg = config.parse(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    sock = short_private_dir()
    sock.mkdir(mode=0o700)
    sock = sock / "engine.sock"
    engine = ScriptedEngine(sock, script)
    log = RequestLog(cfg.database_path, keep_text=False)
    log.start()
    gw = Gateway(EngineSupervisor(cfg, []), GatewaySettings("m", 1 << 20, 3, timeout_s, engine_socket=sock), log,
                 Metrics(), cascade=cascade)
    gw.supervisor.launch = build_launch(cfg, [], "k")
    gw.supervisor.status.state = EngineState.READY
    app = create_app(gw, verifier=keys.KeyVerifier(cfg.database_path, ttl_s=5), keys_required=False)
    running = serve_in_thread(app, http=GuardedHttpProtocol.configured(
        header_timeout_s=5, body_timeout_s=5, max_connections=64, retry_after_s=1))
    try:
        yield running.port, engine, gw, cfg.database_path
    finally:
        running.stop()
        engine.stop()
        log.close()


def logged(db: Path, count: int = 1) -> list[tuple]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with sqlite3.connect(db) as c:
            rows = c.execute("select status, error_code, completion_tokens from requests order by ts").fetchall()
        if len(rows) >= count:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"the request log holds {rows}, not {count} rows")


@pytest.fixture
def spliced():
    """Counts the streams that went the spliced way, so a test fails if the gateway fell back."""
    with mock.patch.object(splice.SplicedStream, "_pump", autospec=True, side_effect=splice.SplicedStream._pump) as pump:
        yield pump


def test_a_spliced_stream_arrives_whole_with_the_usage_taken_for_the_log_and_removed(tmp_path, spliced):
    async def script(reader, writer):
        await send_head(writer)
        for i in range(5):
            await send_chunk(writer, event(i))
        whole = event(5) + USAGE + DONE  # one event split across two chunks: only whole events go out
        await send_chunk(writer, whole[:30])
        await asyncio.sleep(0.05)
        await send_chunk(writer, whole[30:])
        await send_end(writer)

    with gateway_on(tmp_path, script) as (port, engine, gw, db), loopback.client() as c:
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            body = b"".join(r.iter_raw())
        assert body == b"".join(event(i) for i in range(6)) + DONE  # the usage the client did not ask for: gone
        sent = json.loads(engine.requests[0].split(b"\r\n\r\n", 1)[1])
        assert sent["stream_options"] == {"include_usage": True}  # asked of the engine for the log
        assert logged(db) == [(200, None, 7)]
        assert gw.local_in_flight == 0
        # The same keep-alive connection serves the next stream: uvicorn saw the first one complete.
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            assert b"".join(r.iter_raw()).endswith(DONE)
    assert spliced.call_count == 2


def test_an_engine_that_breaks_off_mid_stream_ends_it_with_an_error_event(tmp_path, spliced):
    async def script(reader, writer):
        await send_head(writer)
        for i in range(3):
            await send_chunk(writer, event(i))
        writer.transport.abort()

    with gateway_on(tmp_path, script) as (port, _, gw, db), loopback.client() as c:
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            body = b"".join(r.iter_raw())
        assert body.startswith(event(0) + event(1) + event(2))
        last = json.loads(body.rstrip().rsplit(b"\n\n", 1)[-1][6:])
        assert last["error"]["code"] == "engine_stream_broken"
        assert logged(db) == [(502, "engine_stream_broken", None)]
        assert gw.local_in_flight == 0
    assert spliced.call_count == 1


def test_an_engine_silent_past_the_upstream_timeout_ends_the_stream_with_an_error_event(tmp_path, spliced):
    async def script(reader, writer):
        await send_head(writer)
        await send_chunk(writer, event(0))
        await asyncio.sleep(30)

    with gateway_on(tmp_path, script, timeout_s=0.5) as (port, _engine, _, db), loopback.client(timeout=10) as c:
        t0 = time.monotonic()
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            body = b"".join(r.iter_raw())
        assert time.monotonic() - t0 < 5
        assert json.loads(body.rstrip().rsplit(b"\n\n", 1)[-1][6:])["error"]["code"] == "engine_stream_broken"
        assert logged(db) == [(502, "engine_stream_broken", None)]
    assert spliced.call_count == 1


@pytest.mark.parametrize("engine", ["streaming", "silent"])
def test_a_client_that_leaves_mid_stream_closes_the_engine_connection(tmp_path, spliced, engine):
    """Noticed by the next chunk's write (the engine still streaming) or by the server's disconnect (the
    engine silent, thinking about its next token)."""
    hung_up = threading.Event()

    async def script(reader, writer):
        await send_head(writer)
        for i in range(400 if engine == "streaming" else 1):  # 20 s of answer unless the gateway hangs up
            await send_chunk(writer, event(i))
            if engine == "streaming":
                await asyncio.sleep(0.05)
        with contextlib.suppress(ConnectionError):
            await reader.read(1)  # silent until the gateway closes the connection (EOF or a reset)
        hung_up.set()

    with gateway_on(tmp_path, script) as (port, engine_, gw, db), loopback.client() as c:
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            for chunk in r.iter_raw():
                if chunk:
                    break
        closed = engine_.peer_closed if engine == "streaming" else hung_up
        assert closed.wait(3), "the engine's connection was not closed when the client left"
        assert logged(db) == [(499, "client_disconnected", None)]
        assert gw.local_in_flight == 0
    assert spliced.call_count == 1


def test_a_client_reading_slower_than_the_engine_writes_gets_every_event_in_order(tmp_path, spliced):
    big = [b'data: {"choices":[{"delta":{"content":"%d %s"}}]}\n\n' % (i, b"x" * 8000) for i in range(4000)]

    sent = [0]

    async def script(reader, writer):
        await send_head(writer)
        for e in big:
            await send_chunk(writer, e)
            sent[0] += 1
        await send_chunk(writer, DONE)
        await send_end(writer)

    # The client stops reading for far longer than the upstream timeout: the engine's silence while the
    # gateway holds it back is not the engine's fault.
    with gateway_on(tmp_path, script, timeout_s=0.3) as (port, _, _, db), loopback.client(timeout=20) as c:
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            got = []
            for i, chunk in enumerate(r.iter_raw(65536)):
                got.append(chunk)
                if i < 3:
                    time.sleep(1.0)  # 32 MB from the engine at once: the client's socket fills up
                if i == 0:  # the gateway held the engine back rather than buffer its whole answer
                    assert sent[0] < len(big) * 3 // 4, f"the engine wrote {sent[0]} of {len(big)} events unhindered"
        assert b"".join(got) == b"".join(big) + DONE
        assert logged(db)[0][0] == 200
    assert spliced.call_count == 1


def test_an_engine_refusal_is_read_whole_and_a_missing_engine_socket_is_a_503(tmp_path, spliced):
    async def script(reader, writer):
        body = json.dumps({"object": "error", "message": "bad temperature", "type": "BadRequestError",
                           "code": 400}).encode()
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()

    with gateway_on(tmp_path, script) as (port, engine, gw, _), loopback.client() as c:
        r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        assert r.status_code == 400 and "bad temperature" in r.json()["error"]["message"]
        engine.stop()
        engine.path.unlink()
        r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unreachable"
        assert r.headers["retry-after"] == "3"
        assert gw.local_in_flight == 0
    assert spliced.call_count == 0  # neither was a stream


def test_in_process_tests_run_the_same_splice_over_asgi_send(tmp_path, spliced):
    """httpx's ASGI transport (the in-process harness) puts no ClientWriter in the scope: the gateway splices
    all the same, writing through AsgiWriter, and the stream arrives whole with the usage stripped."""
    import httpx

    from tests.unit.appliance.api.inprocess import serving

    async def chunks():
        for i in range(3):
            yield event(i)
        yield USAGE + DONE

    made = serving(tmp_path, lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                                       content=chunks()))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json=CHAT)

    try:
        r = asyncio.run(go())
        assert r.status_code == 200 and r.content == event(0) + event(1) + event(2) + DONE
        assert logged(made.cfg.database_path) == [(200, None, 7)]
        assert made.gateway.local_in_flight == 0
    finally:
        made.log.close()
    assert spliced.call_count == 1


def test_asgi_writer_pauses_past_its_high_water_and_reports_a_failed_send():
    sent: list[bytes] = []
    gate = asyncio.Event()

    async def send(message):
        await gate.wait()
        if message["body"] == b"boom":
            raise OSError("gone")
        sent.append(message["body"])

    async def scenario():
        out = splice.AsgiWriter(send, high_water=4)
        assert out.write(b"abc") and not out.paused
        assert out.write(b"defg") and out.paused  # 7 bytes wait to be sent
        assert out.write(b"")  # nothing queued: an empty body message would say nothing
        gate.set()
        await out.drain()
        assert sent == [b"abc", b"defg"] and not out.paused and not out.gone
        out.write(b"boom")
        await out.flush()
        assert out.gone and not out.write(b"more")

    asyncio.run(scenario())


def test_a_judged_stream_holds_its_done_until_the_judge_has_queued_the_escalation(tmp_path, spliced):
    """Under the auto policy the splice's end hook runs the judge once the engine's answer is complete: a
    doubtful answer's escalation is named in a comment before [DONE], and the log-probabilities the gateway
    asked for are hidden from a client that did not."""
    from cascade.outbox import Outbox
    from cascade.policy import PolicyConfig, Thresholds
    from cascade.service import Cascade

    doubtful = (b'data: {"choices":[{"index":0,"delta":{"content":"x"},"logprobs":{"content":[{"token":"x",'
                b'"logprob":-9.0,"top_logprobs":[{"token":"x","logprob":-9.0},{"token":"y","logprob":-9.1}]}]}}]}\n\n')

    async def script(reader, writer):
        await send_head(writer)
        for _ in range(4):
            await send_chunk(writer, doubtful)
        await send_chunk(writer, USAGE + DONE)
        await send_end(writer)

    box = Outbox(tmp_path / "outbox.db")
    cascade = Cascade(PolicyConfig(regional_enabled=True, default="auto", local_model="m",
                                   thresholds=Thresholds(quantile_logprob=-1.6)), box, None, None)
    with gateway_on(tmp_path, script, cascade=cascade) as (port, engine, _, db), loopback.client() as c:
        with c.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
            body = b"".join(r.iter_raw())
        sent = json.loads(engine.requests[0].split(b"\r\n\r\n", 1)[1])
        assert sent["logprobs"] is True  # asked of the engine for the judge
        assert body.endswith(DONE) and b"\"logprob\"" not in body and b"\"logprobs\": null" in body
        assert b"usage" not in body  # the client did not ask for it (found here: hiding logprobs re-encoded it)
        comment = body.rsplit(b"\n\n", 3)[-3]
        assert comment.startswith(b": appliance-escalation-id="), body[-300:]
        assert box.stats()["depth"] == 1
        # kept with the escalation for the label its regional answer will make (cascade.labels)
        local, signals = box.db.execute("SELECT local_answer, local_signals FROM escalations").fetchone()
        assert local == "xxxx" and json.loads(signals)["quantile_logprob"] == -9.0
        assert logged(db) == [(200, None, 7)]
    assert spliced.call_count == 1
