"""The generation requests' way to the engine's port: aiohttp, not httpx.

Measured with `python bench/upstream_clients.py` (2026-11-23, bench/RESULTS.md): reading one 64-event SSE
answer costs the client 5.8 ms of CPU with httpx and 1.5 ms with aiohttp, where httpx spends it on anyio cancel scopes and its
pure-Python HTTP/1.1 parser for every chunk read. Everything infrequent (the model list, the engine's
/metrics) stays on the gateway's httpx client.

A test that stands in for the engine gives the gateway an httpx transport (httpx.MockTransport): then
the same interface runs over the gateway's httpx client, which carries that transport. Both answer with an `Upstream`: a status, the raw body as it arrives, the whole
body, and a close that drops the connection when the body was not read to its end, which is how vLLM
learns to abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import aiohttp
import httpx

# What a failed exchange with the engine raises, from either client.
UPSTREAM_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientError, asyncio.TimeoutError, httpx.HTTPError)


class Upstream(Protocol):
    status_code: int

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class _AiohttpUpstream:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._r = response
        self.status_code = response.status

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self._r.content.iter_any():
            yield chunk

    async def aread(self) -> bytes:
        return await self._r.read()

    async def aclose(self) -> None:
        if self._r.content.at_eof():
            self._r.release()  # read to its end: the connection goes back to the pool
        else:
            self._r.close()  # the engine sees the connection drop and aborts the request


class EngineLink:
    """POST a generation request to the engine and get its answer as it streams."""

    def __init__(self, timeout_s: float, socket_path: Path | None, stand_in: httpx.AsyncClient | None = None) -> None:
        """socket_path: the engine's Unix socket; stand_in: an httpx client to use instead of aiohttp (a
        test's fake engine), not closed here."""
        self._timeout_s = timeout_s
        self._socket = socket_path
        self._httpx = stand_in
        self._session: aiohttp.ClientSession | None = None  # made on first use: it binds to the running loop

    def _aiohttp(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._socket is None:
                raise RuntimeError("no engine socket: the engine is reached through it, or a test's stand-in")
            self._session = aiohttp.ClientSession(
                # Keep-alive connections to the engine save a connection set-up per request.
                connector=aiohttp.UnixConnector(str(self._socket), limit=512, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=self._timeout_s),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def post(self, url: str, content: bytes, headers: dict[str, str]) -> Upstream:
        if self._httpx is not None:
            req = self._httpx.build_request("POST", url, content=content, headers=headers)
            return await self._httpx.send(req, stream=True)
        response = await self._aiohttp().post(url, data=content, headers=headers)
        return _AiohttpUpstream(response)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
