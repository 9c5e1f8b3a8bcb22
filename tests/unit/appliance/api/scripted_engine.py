"""A stand-in engine on a Unix socket, where the real one listens: the gateway reaches it the way it
reaches vLLM (appliance.api.engine_stream, its httpx client for the model list), so in-process tests run
the splice production runs.

Two ways to script it: `script(reader, writer)` writes the answer byte by byte (every way a stream can end);
`handler(httpx.Request) -> httpx.Response` answers as httpx.MockTransport's handlers do (a body given as
an async iterator is sent chunked, a chunk per item, as vLLM streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from tests.support import short_private_dir

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Handler = Callable[[httpx.Request], httpx.Response]

_running: list[ScriptedEngine] = []


class ScriptedEngine:
    """A Unix-socket server in its own thread: each connection's request is read, then answered."""

    def __init__(self, path: Path, script: Script | None = None, handler: Handler | None = None) -> None:
        assert (script is None) != (handler is None), "a script or a handler"
        self.path, self.script, self.handler = path, script, handler
        self.requests: list[bytes] = []
        self.peer_closed = threading.Event()  # a connection was closed by the gateway before the script ended
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self.server = await asyncio.start_unix_server(self._conn, str(path))
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(serve()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        assert ready.wait(5)
        _running.append(self)

    @classmethod
    def answering(cls, handler: Handler) -> ScriptedEngine:
        """An engine that answers with `handler`, on a socket in a fresh private folder."""
        folder = short_private_dir()
        folder.mkdir(mode=0o700)
        return cls(folder / "engine.sock", handler=handler)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        body = await reader.readexactly(int(fields.get("content-length", "0")))
        self.requests.append(head + body)
        try:
            if self.script is not None:
                await self.script(reader, writer)
            else:
                method, target, _ = lines[0].split(" ", 2)
                await self._answer(httpx.Request(method, f"http://engine{target}", headers=fields, content=body), writer)
        except (ConnectionError, OSError):
            self.peer_closed.set()
        finally:
            writer.close()

    async def _answer(self, request: httpx.Request, writer: asyncio.StreamWriter) -> None:
        assert self.handler is not None
        response = self.handler(request)
        try:
            whole: bytes | None = response.content
        except httpx.ResponseNotRead:
            whole = None
        ctype = response.headers.get("content-type", "application/json")
        # Connection: close, so the gateway's pooled httpx client keeps no connection: the in-process tests
        # run each call in its own event loop (asyncio.run), and a connection from a closed loop breaks.
        writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\nconnection: close\r\n" % (
            response.status_code, response.reason_phrase.encode(), ctype.encode()))
        if whole is not None:
            writer.write(b"content-length: %d\r\n\r\n%s" % (len(whole), whole))
            await writer.drain()
            return
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        async for chunk in response.aiter_raw():
            await send_chunk(writer, chunk)
        await send_end(writer)

    def stop(self) -> None:
        """Scripts still running are cancelled, and the thread ends (a second call does nothing)."""
        if not self.thread.is_alive():
            return

        async def shut() -> None:
            self.server.close()
            running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in running:
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def stop_all() -> None:
    """Every engine a test started (tests/unit/conftest.py calls it after each test)."""
    while _running:
        with contextlib.suppress(Exception):
            _running.pop().stop()


async def send_head(writer: asyncio.StreamWriter, status: int = 200) -> None:
    writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" % status)
    await writer.drain()


async def send_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    if data:  # an empty chunk would end the body
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()


async def send_end(writer: asyncio.StreamWriter) -> None:
    writer.write(b"0\r\n\r\n")
    await writer.drain()
