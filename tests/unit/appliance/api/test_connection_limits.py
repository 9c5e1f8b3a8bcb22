"""The connection layer (appliance.api.http_protocol) on a real uvicorn over real sockets: the header and
body deadlines, the connection cap, and malformed framing, each answered with an OpenAI-style body."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from appliance.api.http_protocol import GuardedHttpProtocol
from tests.support import asgi_body, serve_in_thread
from tests.unit.appliance.api.inprocess import serving

LIMITS = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_connections": 3, "retry_after_s": 7}


async def echo(scope, receive, send) -> None:
    body = await asgi_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body or b"ok"})


@contextmanager
def server(app=echo, **limits) -> Iterator[int]:
    running = serve_in_thread(app, http=GuardedHttpProtocol.configured(**{**LIMITS, **limits}))
    try:
        yield running.port
    finally:
        running.stop()


def _answer(sock: socket.socket, within_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Read a whole response until the server closes: its status, headers and body."""
    sock.settimeout(within_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _openai_error(body: bytes, code: str) -> dict:
    err = json.loads(body)["error"]
    assert err["code"] == code and err["message"] and err["type"], err
    return err


def test_a_connection_that_sends_nothing_is_closed_with_408_after_the_header_deadline():
    with server() as port, socket.create_connection(("127.0.0.1", port)) as s:
        t = time.monotonic()
        status, headers, body = _answer(s)
        assert status == 408 and headers["content-type"] == "application/json"
        _openai_error(body, "header_timeout")
        assert 0.4 < time.monotonic() - t < 3


def test_headers_sent_a_byte_at_a_time_do_not_outlast_the_deadline():
    with server() as port, socket.create_connection(("127.0.0.1", port)) as s:
        t = time.monotonic()
        with_body = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        try:
            for byte in with_body:
                s.sendall(bytes([byte]))
                time.sleep(0.05)  # 5 s for all of it, far past the deadline
        except OSError:
            pass  # the server closed it under us: what is asked
        status, _, body = _answer(s)
        assert status == 408 and time.monotonic() - t < 4
        _openai_error(body, "header_timeout")


def test_a_keep_alive_connection_idle_between_requests_is_not_cut_by_the_header_deadline():
    # A raw socket, not a pooled client: one that quietly reconnects would hide a cut connection.
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    with server() as port, socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # twice the header deadline; uvicorn's keep-alive timeout (5 s) governs here
        s.sendall(request)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_body_slower_than_its_deadline_gets_408():
    with server() as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        status, _, body = _answer(s)
        assert status == 408
        _openai_error(body, "body_timeout")


def test_connections_past_the_cap_get_503_with_retry_after_and_the_others_keep_working():
    with server(header_timeout_s=30) as port:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        try:
            time.sleep(0.2)  # accepted by the server
            with socket.create_connection(("127.0.0.1", port)) as extra:
                status, headers, body = _answer(extra)
            assert status == 503 and headers["retry-after"] == "7"
            _openai_error(body, "too_many_connections")
            held[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _answer(held[0])[0] == 200
        finally:
            for s in held:
                s.close()


def test_malformed_framing_gets_a_json_400_not_text():
    with server() as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello")
        status, headers, body = _answer(s)
        assert status == 400 and headers["content-type"] == "application/json"
        _openai_error(body, "bad_http_request")


def test_a_client_still_sending_when_refused_reads_the_refusal_not_a_reset():
    """Found by the fuzz suite: a request malformed in its first piece was refused and the socket closed at
    once, so the client's next piece met a closed socket and the kernel's reset threw the unread 400 away:
    the client saw 'connection reset' and no answer. The refusal now lingers (as nginx does): the answer,
    then FIN, and what the client still sends is read and dropped until it closes or the linger ends."""
    with server() as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"G ET /v1/models HTTP/1.1\r\n")
        time.sleep(0.3)  # the server has refused and, without lingering, closed
        s.sendall(b"Host: x\r\nContent-Length: 100000\r\n\r\n")
        time.sleep(0.1)
        s.sendall(b"x" * 100_000)
        status, headers, body = _answer(s)
    assert status == 400 and headers["content-type"] == "application/json"
    _openai_error(body, "bad_http_request")


def test_garbage_after_a_request_being_served_ends_it_cleanly():
    """Found by the fuzz suite: a request followed on its connection by bytes that are not HTTP. The refusal
    (400, FIN) went out while the first request was still being served, whose answer then met a half-closed
    transport: RuntimeError in the app, a traceback per connection. That request is now over with the
    connection (its answer dropped, as for a client that left), and the client reads the 400."""
    import asyncio

    failures: list[BaseException] = []

    async def slow(scope, receive, send) -> None:
        await asgi_body(receive)
        await asyncio.sleep(0.3)  # the garbage behind the request is refused meanwhile
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        except BaseException as e:
            failures.append(e)
            raise

    with server(slow) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiGARBAGE / HTTP/1.1\r\n\r\n")
        status, headers, body = _answer(s)
        time.sleep(0.5)
    assert status == 400 and headers["content-type"] == "application/json"
    _openai_error(body, "bad_http_request")
    assert failures == []


def test_the_gateway_records_a_body_timeout_as_408_in_the_request_log(tmp_path):
    made = serving(tmp_path, lambda req: httpx.Response(500))
    with server(made.app) as port, socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n{\"model\": ")
        status, _, body = _answer(s)
        assert status == 408
        _openai_error(body, "body_timeout")
    made.log.close()
    with sqlite3.connect(made.cfg.database_path) as db:
        rows = db.execute("select status, error_code from requests").fetchall()
    assert rows == [(408, "body_timeout")]
