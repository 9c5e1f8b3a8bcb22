"""The regional side in tests: a recording front for a real OpenAI server, and a TCP fault injector.

    appliance --> FaultInjector (pass | cut | blackhole | slow) --> RegionalRecorder --> regional vLLM

The recorder keeps every request it receives (key, body, time) and every one it applied (passed on to the
model and answered). Like a regional gateway that honours idempotency keys, it applies a key once and
answers a repeat of it with the stored answer; a resend under a new key is applied again, as it would be
for real. `delivery_problems` checks escalations against both logs by their bodies, not by their keys
alone, so a duplicate under any key shows. It can also misbehave (garbage, 500s).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests import loopback
from tests.support import serve_in_thread

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
        self._loop = _Loop()
        self._conns: set[asyncio.StreamWriter] = set()
        self._server = self._loop.run(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]

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


MARKER = re.compile(r"marker-[0-9a-f]{12}")


def marker() -> str:
    """A token to put in a request's text, so its body can be told apart wherever it arrives."""
    return f"marker-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, eq=False)
class Arrival:
    """One request as the regional side received it."""
    key: str | None  # its Idempotency-Key
    body: dict
    at: float  # time.time()
    path: str
    markers: frozenset[str] = field(default=frozenset())  # the marker() tokens its body carries
    scheduling: dict[str, str] = field(default_factory=dict)  # the llm-d gateway headers it carried

    @classmethod
    def of(cls, key: str | None, body: dict, path: str, headers: Mapping[str, str] | None = None) -> Arrival:
        scheduling = {k.lower(): v for k, v in (headers or {}).items()
                      if k.lower().startswith(("x-gateway-inference-", "x-slo-"))}
        return cls(key, body, time.time(), path, frozenset(MARKER.findall(json.dumps(body))), scheduling)


class RegionalRecorder:
    def __init__(self, upstream: str, token: str | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.token = token
        # drop: what an overloaded llm-d gateway answers (503, its drop reason, Retry-After: drop_retry_after)
        self.behaviour: Literal["normal", "garbage", "error500", "canned", "drop"] = "normal"
        self.drop_retry_after = 2
        self.arrivals: list[Arrival] = []  # every request received, in order
        self.applications: list[Arrival] = []  # those answered by the model (or canned), not from the store
        self._answers: dict[str, dict] = {}
        self._key_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/chat/completions", self._complete, methods=["POST"]),
                                Route("/v1/completions", self._complete, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])])
        self._server = serve_in_thread(app)
        self.port = self._server.port
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
        arrival = Arrival.of(request.headers.get("idempotency-key"), body, request.url.path, request.headers)
        with self._lock:
            self.arrivals.append(arrival)
        if self.behaviour == "garbage":
            return Response(b"<html>proxy error</html>", status_code=200, media_type="text/html")
        if self.behaviour == "drop":
            return JSONResponse({"error": {"message": "request dropped"}}, status_code=503,
                                headers={"x-llm-d-request-dropped-reason": "saturated",
                                         "retry-after": str(self.drop_retry_after)})
        if self.behaviour == "error500":
            return JSONResponse({"error": {"message": "regional overloaded"}}, status_code=500)
        # Concurrent repeats of a key wait for the first; a request without a key has nothing to wait for.
        async with self._key_locks[arrival.key] if arrival.key is not None else contextlib.nullcontext():
            if arrival.key is not None and arrival.key in self._answers:
                return JSONResponse(self._answers[arrival.key])  # a repeated key: the stored answer, not applied
            status, content = await self._apply(arrival)
            if status == 200:
                with self._lock:
                    self.applications.append(arrival)
                if arrival.key is not None:
                    self._answers[arrival.key] = json.loads(content)
        return Response(content, status_code=status, media_type="application/json")

    async def _apply(self, arrival: Arrival) -> tuple[int, bytes]:
        if self.behaviour == "canned":  # benchmarks of the appliance's side: no model behind the front
            return 200, json.dumps(CANNED).encode()
        if self._client is None:
            self._client = loopback.async_client(timeout=300)
        r = await self._client.post(f"{self.upstream}{arrival.path}", json=arrival.body)
        return r.status_code, r.content

    @property
    def received(self) -> collections.Counter[str]:
        """Idempotency key -> requests received under it."""
        with self._lock:
            return collections.Counter(a.key for a in self.arrivals if a.key is not None)

    @property
    def applied(self) -> collections.Counter[str]:
        """Idempotency key -> times applied under it (at most 1: a repeated key gets the stored answer)."""
        with self._lock:
            return collections.Counter(a.key for a in self.applications if a.key is not None)

    def mark(self) -> int:
        """Where the logs stand now: pass it as `since` to look only at what came after."""
        with self._lock:
            return len(self.arrivals)

    def arrivals_with(self, marker: str) -> list[Arrival]:
        with self._lock:
            return [a for a in self.arrivals if marker in a.markers]

    def bodies_with(self, marker: str) -> list[dict]:
        with self._lock:
            return [a.body for a in self.arrivals if marker in a.markers]

    def delivery_problems(self, expected: Mapping[str, str], since: int = 0) -> list[str]:
        """What is wrong with the delivery of `expected` (escalation id -> the marker() only its body
        carries), judged on every request received since `since`: each id arrived under its own key with
        its own body, each body was applied exactly once and under its id, and nothing arrived without a
        key or under a key that is not one of the ids. Empty when all is well."""
        with self._lock:
            arrivals = self.arrivals[since:]
            window = {id(a) for a in arrivals}
            applied = [a for a in self.applications if id(a) in window]
        by_key: collections.defaultdict[str | None, list[Arrival]] = collections.defaultdict(list)
        applied_with: collections.defaultdict[str, list[Arrival]] = collections.defaultdict(list)
        for a in arrivals:
            by_key[a.key].append(a)
        for a in applied:
            for m in a.markers:
                applied_with[m].append(a)
        problems = [f"a request arrived without an Idempotency-Key: {json.dumps(a.body)[:200]}" for a in by_key[None]]
        problems += [f"{len(got)} request(s) arrived under {key!r}, which is no escalation id"
                     for key, got in by_key.items() if key is not None and key not in expected]
        for esc_id, mark in expected.items():
            if not by_key[esc_id]:
                problems.append(f"{esc_id}: never arrived")
            problems += [f"{esc_id}: arrived with another body than its own" for a in by_key[esc_id]
                         if mark not in a.markers]
            once = applied_with[mark]
            if len(once) != 1:
                problems.append(f"{esc_id}: its body was applied {len(once)} times, under keys {[a.key for a in once]}")
            elif once[0].key != esc_id:
                problems.append(f"{esc_id}: its body was applied under {once[0].key!r}")
        return problems

    def reset(self) -> None:
        with self._lock:
            self.arrivals.clear()
            self.applications.clear()
            self.behaviour = "normal"

    def close(self) -> None:
        self._server.stop()
