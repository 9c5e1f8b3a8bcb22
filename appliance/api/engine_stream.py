"""One generation request to the engine, at the level of the socket: an asyncio protocol that writes the
HTTP/1.1 request itself and reads the answer through httptools' parser (uvicorn's own, in C).

Why not an HTTP client library: measured with `python bench/gateway_floor.py` (bench/RESULTS.md), the
least relay on the best client (aiohttp, already 3.9x cheaper than httpx: bench/upstream_clients.py)
costs 3.2 ms of CPU per 64-event stream, against nginx's 1.2 to 1.4 ms; a relay whose engine leg is this
protocol, writing each chunk straight to the client's connection, costs 1.7 ms. What a library adds per
chunk (a future, a coroutine step, a stream reader's buffer) is most of a relay's cost, and the engine
leg needs none of its features: one request per connection on a private Unix socket, no TLS, redirects,
cookies or compression.

Each request has its own connection, closed when it ends (as nginx talks to its upstreams by default): a
client that leaves closes it, and that is how vLLM learns to abort the request and free its KV blocks.

The answer is read in one of two ways. As a client library's answer would be (status, chunks, whole
body, close): a refusal read whole, a stream's first event. Or spliced (`splice`): every further body chunk goes to a plain function as the
parser produces it, with no coroutine in between (appliance.api.splice writes them to the client).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from pathlib import Path

import httptools


class EngineLinkError(ConnectionError):
    """The engine could not be reached, broke off its answer, sent nothing for too long, or sent
    something that is not HTTP."""


class EngineRefused(EngineLinkError):
    """Nothing listens on the engine's socket: the request was not sent, so it may wait and go again."""


class EngineStream(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self._loop = loop
        self.idle_s = idle_s  # the engine silent this long (up to twice this) breaks the answer off
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status_code = 0
        self.received = 0  # body chunks so far: silence is judged by whether this moved
        self._head: asyncio.Future[None] = loop.create_future()
        self._end: asyncio.Future[None] = loop.create_future()
        self._pending: deque[bytes] = deque()  # body not yet taken by a reader
        self._wake: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._paused = False  # reading paused for a slow client: silence then is not the engine's
        self._silence: asyncio.TimerHandle | None = None

    # -- opening ---------------------------------------------------------------------------

    @classmethod
    async def open(cls, socket_path: Path, path: str, body: bytes, headers: dict[str, str], *,
                   connect_s: float, idle_s: float) -> EngineStream:
        """POST `body` to `path` on the engine's socket; returns once the answer's status and headers are in."""
        loop = asyncio.get_running_loop()
        head = [f"POST {path} HTTP/1.1", "Host: engine", f"Content-Length: {len(body)}", "Connection: close"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:  # the gateway checks what it passes on; this is the last guard
                raise ValueError(f"header {name} holds a line break")
            head.append(f"{name}: {value}")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        try:
            transport, stream = await asyncio.wait_for(
                loop.create_unix_connection(lambda: cls(loop, idle_s), str(socket_path)), connect_s)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            raise EngineRefused(f"nothing listens on the engine's socket {socket_path}: {e}") from e
        except (TimeoutError, OSError) as e:
            raise EngineLinkError(f"cannot connect to the engine's socket {socket_path}: {e or type(e).__name__}") from e
        stream.transport = transport  # uvloop may call connection_made only after this returns
        transport.write(request)
        try:
            await asyncio.wait_for(asyncio.shield(stream._head), idle_s)
        except TimeoutError:
            stream.abort()
            raise EngineLinkError(f"the engine sent no answer within {idle_s:g}s") from None
        except BaseException:
            stream.abort()
            raise
        stream._arm_silence()
        return stream

    # -- read as a client library's answer ----------------------------------------------------------------

    def aiter_raw(self) -> EngineStream:
        return self

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._pending:
            if self._end.done():
                self._end.result()  # raises how it broke off
                raise StopAsyncIteration
            self._wake = self._loop.create_future()
            await self._wake
        return self._pending.popleft()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        self.abort()

    # -- spliced -------------------------------------------------------------------------------

    def splice(self, sink: Callable[[bytes], None]) -> asyncio.Future[None]:
        """Hand every body chunk from now on to `sink` as it is parsed (what is pending first). Returns the
        future of the answer's end: a result when it ended whole, EngineLinkError when it broke off."""
        self._sink = sink
        pending, self._pending = self._pending, deque()
        for chunk in pending:
            sink(chunk)
        return self._end

    def pause_reading(self) -> None:
        self._paused = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        self._paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection (the engine aborts the request when it was still answering)."""
        if self.transport is not None:
            self.transport.close()
        self._finish(EngineLinkError("closed by the gateway"))

    # -- asyncio.Protocol and httptools' callbacks -----------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a Unix socket's: a full Transport

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(EngineLinkError(f"the engine's answer is not valid HTTP: {e}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._head.done():
            # Not a byte of an answer: an engine that died with the request in its socket's queue. Nothing
            # was answered, so the request may wait for the restart and go again, as a refused one does.
            self._finish(EngineRefused("the engine closed the connection before it answered"))
            return
        self._finish(EngineLinkError("the engine closed the connection before its answer ended"))

    def on_headers_complete(self) -> None:
        self.status_code = self._parser.get_status_code()
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.received += 1
        if self._sink is not None:
            self._sink(body)
            return
        self._pending.append(body)
        self._wakeup()

    def on_message_complete(self) -> None:
        self._finish(None)
        if self.transport is not None:
            self.transport.close()

    def _watch_silence(self, seen: int) -> None:
        """Every idle_s: an engine that sent nothing since the last look (and was not paused) has broken
        off. One timer per idle_s, not one per chunk, so silence is noticed after idle_s to twice that."""
        if self._end.done():
            return
        if self.received == seen and not self._paused:
            self._finish(EngineLinkError(f"the engine sent nothing for {self.idle_s:g}s"))
            if self.transport is not None:
                self.transport.close()
            return
        self._arm_silence()

    def _arm_silence(self) -> None:
        self._silence = self._loop.call_later(self.idle_s, self._watch_silence, self.received)

    def _finish(self, error: Exception | None) -> None:
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None
        for fut in (self._head, self._end):
            if not fut.done():
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)
                    # Retrieved or not, the reason is in the request log; no "never retrieved" warning.
                    with contextlib.suppress(BaseException):
                        fut.exception()
        self._wakeup()

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
