"""The tests' port helpers leave no two servers of a session the same port (tests/support.py).

CI once failed the cascade module at setup: the regional decode vLLM was handed a port, and while it started
(tens of seconds) the fault injector was handed the same one and bound it first; vLLM died with EADDRINUSE."""

from __future__ import annotations

import socket

import httpx
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests import loopback, support


class _Kernel:
    """socket.socket whose bind(0) picks the ports given, in order: the kernel's pick is random, so a repeat
    cannot be had on demand from the real one."""

    def __init__(self, picks: list[int]) -> None:
        self.picks = picks
        self.bound: list[int] = []
        self.closed: list[int] = []
        kernel = self

        class Sock:
            def __init__(self, *args) -> None:
                self.port = 0

            def bind(self, addr) -> None:
                self.port = kernel.picks.pop(0)
                kernel.bound.append(self.port)

            def getsockname(self):
                return ("127.0.0.1", self.port)

            def close(self) -> None:
                kernel.closed.append(self.port)

        self.socket = Sock


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    kernel = _Kernel([41001, 41001, 41003])
    monkeypatch.setattr(support, "_HANDED_OUT", set())
    monkeypatch.setattr(support.socket, "socket", kernel.socket)
    first, second = support.free_port(), support.free_port()
    assert (first, second) == (41001, 41003), "the kernel picked 41001 again and free_port handed it out twice"
    assert sorted(kernel.closed) == [41001, 41001, 41003], "every probe socket is closed again"


def test_a_server_in_this_process_holds_its_port_from_the_start():
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("up"))])
    running = support.serve_in_thread(app)
    try:
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                other.bind(("127.0.0.1", running.port))
                taken = False
            except OSError:
                taken = True
        assert taken, f"port {running.port} could be bound by another socket while the server listened on it"
        assert loopback.get(f"http://127.0.0.1:{running.port}/", timeout=5).text == "up"
    finally:
        running.stop()
    try:
        loopback.get(f"http://127.0.0.1:{running.port}/", timeout=2)
        raise AssertionError("the server still answers after stop()")
    except httpx.HTTPError:
        pass
