"""The generation requests' way to the engine's port: appliance.api.engine_stream, a protocol of our own
over the engine's Unix socket (that module says why, with the measurements).

A test that stands in for the engine gives the gateway an httpx transport (httpx.MockTransport): then
the same interface runs over the gateway's httpx client, which carries that transport. Both answer with
an `Upstream`: a status, the raw body as it arrives, the whole body, and a close that drops the
connection when the body was not read to its end, which is how vLLM learns to abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import httpx

from appliance.api.engine_stream import EngineLinkError, EngineStream

# What a failed exchange with the engine raises, from either way of reaching it.
UPSTREAM_ERRORS: tuple[type[Exception], ...] = (EngineLinkError, asyncio.TimeoutError, httpx.HTTPError)

CONNECT_S = 5.0


class Upstream(Protocol):
    status_code: int

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class EngineLink:
    """POST a generation request to the engine and get its answer as it streams."""

    def __init__(self, timeout_s: float, socket_path: Path | None, stand_in: httpx.AsyncClient | None = None) -> None:
        """timeout_s: the longest the engine may stay silent; socket_path: the engine's Unix socket;
        stand_in: an httpx client to use instead (a test's fake engine), not closed here."""
        self._timeout_s = timeout_s
        self._socket = socket_path
        self._httpx = stand_in

    async def post(self, url: str, content: bytes, headers: dict[str, str]) -> Upstream:
        if self._httpx is not None:
            req = self._httpx.build_request("POST", url, content=content, headers=headers)
            return await self._httpx.send(req, stream=True)
        if self._socket is None:
            raise RuntimeError("no engine socket: the engine is reached through it, or a test's stand-in")
        path = "/" + url.split("/", 3)[3]  # http://engine/v1/...: the socket is the address, the path is what counts
        return await EngineStream.open(self._socket, path, content, headers,
                                       connect_s=CONNECT_S, idle_s=self._timeout_s)

    async def aclose(self) -> None:
        """Nothing pooled: each request's connection closes with it."""
