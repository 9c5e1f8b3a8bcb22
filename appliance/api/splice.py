"""A local stream relayed without a coroutine step per chunk.

Measured with `python bench/gateway_floor.py` (bench/RESULTS.md): what a Python relay costs per stream is
Python touching every chunk on its way, twice (the HTTP client's read, then ASGI's send through each
middleware to the server), not the gateway's own work. Here the engine leg's parser
(appliance.api.engine_stream) hands each chunk to the request's EventFilter, and what the filter passes
is written straight onto the client's connection, framed as uvicorn's own send would frame it
(`ClientWriter`, which the connection layer puts in the request's scope). Only the response's start and
end go through ASGI's send, so uvicorn's view of the connection (keep-alive, completion) stays whole.

What the generator relay (appliance.api.relay) does, this does too, from the same EventFilter: whole
events, usage taken and stripped, texts kept, the error event when the engine breaks off or stays
silent past the upstream timeout; a client that leaves closes the engine's connection (vLLM aborts).
A client that reads slower than the engine writes pauses the engine's connection until its own drains.
Streams the cascade judges keep the generator relay: their end waits on the judge, a coroutine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from appliance.api.disconnect import client_leaves
from appliance.api.engine_stream import EngineLinkError, EngineStream
from appliance.api.http_protocol import ClientWriter
from appliance.api.relay import EventFilter


async def _nothing() -> Any:
    yield b""  # StreamingResponse's constructor wants a body; this response never reads it


class SplicedStream(StreamingResponse):
    def __init__(self, upstream: EngineStream, first: bytes, events: EventFilter, writer: ClientWriter, *,
                 on_close: Callable[[], Awaitable[None]], headers: dict[str, str],
                 background: BackgroundTask | None) -> None:
        super().__init__(_nothing(), media_type="text/event-stream", headers=headers, background=background)
        self._upstream, self._first, self._events, self._out = upstream, first, events, writer
        self._on_close = on_close
        self._resume: asyncio.Task[None] | None = None  # waiting for the client's connection to drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if not self._out.framed:
                raise RuntimeError("uvicorn did not frame this response as chunked; it cannot be spliced")
            await self._pump(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self._resume is not None:
                self._resume.cancel()
            await self._on_close()
            self._events.finish()
        if self.background is not None:
            await self.background()

    def _sink(self, chunk: bytes) -> None:
        """Every chunk the engine sends, as its parser produces it."""
        ready = self._events.feed(chunk)
        if not ready:
            return
        out = self._out
        if not out.write(ready):  # the client has gone: the pump hears it too, and on_close drops the engine
            return
        self._events.flight.sent()
        if out.paused and self._resume is None:
            # The client reads slower than the engine writes: stop reading the engine until it drains.
            self._upstream.pause_reading()
            self._resume = asyncio.ensure_future(self._resume_when_drained())

    async def _resume_when_drained(self) -> None:
        await self._out.drain()
        self._resume = None
        self._upstream.resume_reading()

    async def _pump(self, receive: Any) -> None:
        events, out = self._events, self._out
        if self._first:
            self._sink(self._first)
        end = self._upstream.splice(self._sink)  # broken off, or silent past the upstream timeout: an error
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
        rest = events.rest()
        if rest:
            out.write(rest)
