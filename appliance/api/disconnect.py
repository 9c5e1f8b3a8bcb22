"""Noticing a client that leaves: whatever the gateway is waiting for is cancelled and cleaned up.

A client that goes away closes the upstream connection, which makes vLLM abort the request and free its
KV blocks; an admission slot granted to a client already gone is handed back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from appliance.api.admission import AdmissionRejected
from appliance.api.engine_stream import EngineLinkError, EngineStream


class ClientGone(Exception):
    """The client disconnected while the gateway waited on its behalf."""


async def _close_response(res: EngineStream) -> None:
    await res.aclose()


async def race_disconnect(request: Request, work: Awaitable[Any],
                          discard: Callable[[Any], Awaitable[None]] = _close_response) -> Any:
    """Run `work` unless the client disconnects first; then cancel it, and `discard` a result that
    arrived anyway (an upstream response to close, an admission slot to give back)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(client_leaves(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, AdmissionRejected, EngineLinkError):
            res = await task
            if res is not None:
                await discard(res)
        raise ClientGone()
    finally:
        watcher.cancel()


async def client_leaves(receive: Any) -> None:
    """Returns when the client has gone (the request's ASGI receive says so)."""
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_or_leave(request: Request, upstream: EngineStream) -> bytes:
    """The whole upstream body unless the client leaves first; the upstream is closed either way."""
    try:
        return await race_disconnect(request, upstream.aread())
    finally:
        await upstream.aclose()
