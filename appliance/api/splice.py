"""A local stream relayed without a coroutine step per chunk: the gateway's one way of answering a stream
from the local engine.

Measured with `python bench/gateway_floor.py` (bench/RESULTS.md): what a Python relay costs per stream is
Python touching every chunk on its way, twice (the HTTP client's read, then ASGI's send through each
middleware to the server), not the gateway's own work. Here the engine leg's parser
(appliance.api.engine_stream) hands each chunk to the request's EventFilter, and what the filter passes
is written straight onto the client's connection, framed as uvicorn's own send would frame it
(`ClientWriter`, which the connection layer puts in the request's scope). Only the response's start and
end go through ASGI's send, so uvicorn's view of the connection (keep-alive, completion) stays whole.

On a server that puts no ClientWriter in the scope (another ASGI server, httpx's ASGI transport in the
in-process tests), `AsgiWriter` gives the same interface over ASGI's send: the same splice, one send per
chunk.

The EventFilter keeps whole events, takes and strips the usage, keeps texts, and ends the stream with an
error event when the engine breaks off or stays silent past the upstream timeout; a client that leaves
closes the engine's connection (vLLM aborts). A client that reads slower than the engine writes pauses the
engine's connection until its own drains. A stream the cascade judges has its `[DONE]` held back by the
filter and released by the end hook here, after the judge (a coroutine) has had its say.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.responses import StreamingResponse

from appliance.api.disconnect import client_leaves
from appliance.api.engine_stream import EngineLinkError, EngineStream
from appliance.api.http_protocol import CLIENT_WRITER
from appliance.api.relay import EventFilter


class Writer(Protocol):
    """A started response's body, written chunk by chunk (ClientWriter, AsgiWriter)."""

    @property
    def framed(self) -> bool: ...

    @property
    def gone(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def write(self, data: bytes) -> bool: ...

    async def drain(self) -> None: ...

    async def flush(self) -> None: ...


class AsgiWriter:
    """The ClientWriter's interface over ASGI's send: writes queued in order and sent by one task; while
    more than `high_water` bytes wait, `paused` (the engine's connection is paused until they are sent)."""

    framed = True

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[None]], high_water: int = 1 << 16) -> None:
        self._send, self._high_water = send, high_water
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._task: asyncio.Task[None] | None = None
        self._sent = asyncio.Event()  # nothing waits to be sent
        self._sent.set()
        self.gone = False

    @property
    def paused(self) -> bool:
        return self._queued > self._high_water

    def write(self, data: bytes) -> bool:
        if self.gone:
            return False
        if data:
            self._queue.append(data)
            self._queued += len(data)
            self._sent.clear()
            if self._task is None:
                self._task = asyncio.ensure_future(self._run())
        return True

    async def _run(self) -> None:
        try:
            while self._queue:
                data = self._queue.popleft()
                self._queued -= len(data)
                await self._send({"type": "http.response.body", "body": data, "more_body": True})
        except Exception:  # the server's send failed: the client has gone (what it raises is the server's)
            self.gone = True
            self._queue.clear()
            self._queued = 0
        finally:
            self._task = None
            self._sent.set()

    async def drain(self) -> None:
        await self._sent.wait()

    async def flush(self) -> None:
        await self._sent.wait()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def _nothing() -> Any:
    yield b""  # StreamingResponse's constructor wants a body; this response never reads it


class SplicedStream(StreamingResponse):
    def __init__(self, upstream: EngineStream, first: bytes, events: EventFilter, *,
                 on_close: Callable[[], Awaitable[None]], headers: dict[str, str]) -> None:
        super().__init__(_nothing(), media_type="text/event-stream", headers=headers)
        self._upstream, self._first, self._events = upstream, first, events
        self._on_close = on_close
        self._resume: asyncio.Task[None] | None = None  # waiting for the client's connection to drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        out: Writer = scope.get("extensions", {}).get(CLIENT_WRITER) or AsgiWriter(send)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if not out.framed:
                raise RuntimeError("uvicorn did not frame this response as chunked; it cannot be spliced")
            await self._pump(receive, out)
            await out.flush()
            if not out.gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self._resume is not None:
                self._resume.cancel()
            if isinstance(out, AsgiWriter):
                out.close()
            self._events.finish()  # the text, for the request log's row, before on_close records it
            await self._on_close()

    def _sink(self, out: Writer, chunk: bytes) -> None:
        """Every chunk the engine sends, as its parser produces it."""
        ready = self._events.feed(chunk)
        if not ready:
            return
        if not out.write(ready):  # the client has gone: the pump hears it too, and on_close drops the engine
            return
        self._events.exchange.sent()
        if out.paused and self._resume is None:
            # The client reads slower than the engine writes: stop reading the engine until it drains.
            self._upstream.pause_reading()
            self._resume = asyncio.ensure_future(self._resume_when_drained(out))

    async def _resume_when_drained(self, out: Writer) -> None:
        await out.drain()
        self._resume = None
        self._upstream.resume_reading()

    async def _pump(self, receive: Any, out: Writer) -> None:
        events = self._events

        def sink(chunk: bytes) -> None:
            self._sink(out, chunk)

        if self._first:
            sink(self._first)
        end = self._upstream.splice(sink)  # broken off, or silent past the upstream timeout: an error
        gone = asyncio.ensure_future(client_leaves(receive))
        try:
            done, _ = await asyncio.wait({end, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if gone in done or out.gone:  # on_close drops the engine's connection: vLLM aborts the request
            events.client_left()
            return
        try:
            end.result()
        except EngineLinkError as e:
            out.write(events.broke_off(e))
            return
        # The end hook: a judged stream's held-back end, once the judge has spoken; else what is left.
        tail = await events.ending()
        if tail:
            out.write(tail)
