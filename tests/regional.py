"""The regional side in tests: a recording front for a real OpenAI server, and a TCP fault injector.

    appliance --> FaultInjector (pass | cut | blackhole | slow) --> RegionalRecorder --> regional vLLM

The recorder counts every request by its Idempotency-Key, applies each key once (a repeated key gets
the stored answer, as a regional gateway that honours idempotency keys would), and keeps the bodies, so
tests assert on what the regional side actually received. It can also misbehave (garbage, 500s).
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from typing import Literal

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests import loopback
from tests.support import free_port

LinkMode = Literal["pass", "cut", "blackhole", "slow"]
CANNED = {"id": "canned", "object": "chat.completion", "created": 0, "model": "regional",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


class _Loop:
    """An asyncio loop in a daemon thread, for servers the test process runs beside the appliance."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FaultInjector:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode: LinkMode = "pass"
        self.delay_s = 2.0
        self.port = free_port()
        self._loop = _Loop()
        self._conns: set[asyncio.StreamWriter] = set()
        self._server = self._loop.run(asyncio.start_server(self._handle, "127.0.0.1", self.port))

    def set(self, mode: LinkMode, delay_s: float | None = None) -> None:
        self.mode = mode
        if delay_s is not None:
            self.delay_s = delay_s
        if mode == "cut":
            self._loop.loop.call_soon_threadsafe(self._drop_all)

    def _drop_all(self) -> None:
        for w in list(self._conns):
            w.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            if self.mode == "cut":
                return
            if self.mode == "blackhole":
                while await reader.read(65536):
                    pass  # swallowed: the caller waits for an answer that never comes
                return
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._conns.add(up_w)
            await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)
        except OSError:
            pass
        finally:
            if self.mode != "blackhole":
                self._conns.discard(writer)
                writer.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                if self.mode == "slow":
                    await asyncio.sleep(self.delay_s)
                if self.mode == "cut":
                    break
                if self.mode == "blackhole":
                    continue  # open connections go silent too
                dst.write(data)
                await dst.drain()
        finally:
            if self.mode != "blackhole":  # a black hole does not pass on a close either: the caller just waits
                self._conns.discard(dst)
                dst.close()

    def close(self) -> None:
        self._server.close()
        self._drop_all()
        self._loop.stop()


class RegionalRecorder:
    def __init__(self, upstream: str, token: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.token = token
        self.behaviour: Literal["normal", "garbage", "error500", "canned"] = "normal"
        self.received: collections.Counter[str] = collections.Counter()  # idempotency key -> requests
        self.applied: collections.Counter[str] = collections.Counter()  # idempotency key -> sent upstream
        self.bodies: list[dict] = []
        self.no_key = 0
        self._answers: dict[str, dict] = {}
        self._key_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._lock = threading.Lock()
        self.port = free_port()
        app = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"]),
                                Route("/v1/completions", self._complete, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        self._client: httpx.AsyncClient | None = None

    def _authorised(self, request: Request) -> bool:
        return self.token is None or request.headers.get("authorization") == f"Bearer {self.token}"

    async def _models(self, request: Request) -> Response:
        if not self._authorised(request):
            return JSONResponse({"error": {"message": "bad token"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": "regional"}]})

    async def _complete(self, request: Request) -> Response:
        if not self._authorised(request):
            return JSONResponse({"error": {"message": "bad token", "type": "auth"}}, status_code=401)
        body = await request.json()
        key = request.headers.get("idempotency-key")
        with self._lock:
            self.bodies.append(body)
            if key is None:
                self.no_key += 1
            else:
                self.received[key] += 1
        if self.behaviour == "garbage":
            return Response(b"<html>proxy error</html>", status_code=200, media_type="text/html")
        if self.behaviour == "error500":
            return JSONResponse({"error": {"message": "regional overloaded"}}, status_code=500)
        if self.behaviour == "canned":  # benchmarks of the appliance's side: no model behind the front
            async with self._key_locks[key or ""]:
                if key is not None and key not in self._answers:
                    self._answers[key] = CANNED
                    self.applied[key] += 1
            return JSONResponse(CANNED)
        if self._client is None:
            self._client = loopback.async_client(timeout=300)
        if key is None:
            r = await self._client.post(f"{self.upstream}{request.url.path}", json=body)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        async with self._key_locks[key]:  # one application per key, even for concurrent duplicates
            if key in self._answers:
                return JSONResponse(self._answers[key])  # a duplicate: dropped, the first answer returned
            r = await self._client.post(f"{self.upstream}{request.url.path}", json=body)
            if r.status_code == 200:
                self._answers[key] = r.json()
                self.applied[key] += 1
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    def reset(self) -> None:
        with self._lock:
            self.received.clear()
            self.applied.clear()
            self.bodies.clear()
            self.no_key = 0
            self.behaviour = "normal"

    def bodies_with(self, marker: str) -> list[dict]:
        with self._lock:
            return [b for b in self.bodies if marker in json.dumps(b)]

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
