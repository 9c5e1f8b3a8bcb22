"""One generation request's life, from its arrival to its row in the request log, in one object.

Where does a request's life end, and what is recorded then? Here: `Exchange.close()`, called exactly once
however the request ends (answered, refused, escalated, client gone, engine gone, a fault of the
gateway's own), and idempotent for the paths that might reach it twice. It gives the admission slot back,
takes the request off the engine's drain count and the in-flight view, and writes the metrics and the
request log's row, all from this one object.

The engine is done with a request before the client has its answer (a whole answer is read, then judged
and sent), so `release()` hands back the slot early; `close()` releases too, so nothing can keep a slot.

`Exchanges` holds the open ones: `GET /v1/appliance/requests` lists them (which phase, how far a stream
got: an engine that went silent, a gateway that stopped relaying and a client that stopped reading look
different there), and a planned relaunch waits for those the engine answers (`drained`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import Response

from appliance.api.admission import AdmissionGate, Ticket
from appliance.api.dialects import CHAT, Dialect, take_usage
from appliance.api.errors import ApiError, normalise_error
from appliance.ops.metrics import Metrics
from appliance.store.requests import RequestLog, RequestRecord
from cascade.policy import Decision
from cascade.service import EscalationResult

PHASES = ("held", "admission", "engine", "streaming", "reading", "regional")


@dataclass(eq=False)
class Exchange:
    """A generation request: its row in the request log (`rec`: id, route, model, stream, key, class), what
    it asked for, where it is, and the admission ticket it holds while the engine answers it."""

    rec: RequestRecord
    t0: float  # perf_counter at arrival: total time and time to first token count from here
    cls: str  # priority class
    tenant: str | None
    owner: Exchanges
    dialect: Dialect = CHAT  # the API it speaks: where its usage, text and errors are
    # What it asked for, once the body is read and checked.
    body: dict = field(default_factory=dict)  # what goes to the engine (the gateway adds to it) ...
    original: dict = field(default_factory=dict)  # ... and what the client sent, what an escalation forwards
    client_wants_usage: bool = False
    client_wants_logprobs: bool = False
    decision: Decision | None = None
    prompt_tokens: int = 0  # estimated once (intake.estimate_tokens) for the policy, admission, prefill speed
    max_tokens: int | None = None
    seqs: int = 1  # sequences in the engine: n or best_of
    judge: bool = False  # auto policy: the local answer's confidence is judged
    escalation: EscalationResult | None = None
    # Where it is.
    phase: str | None = None  # None until routed: only routed requests are listed in flight
    started: float = field(default_factory=time.monotonic)
    from_engine: int = 0  # chunks read from the engine's answer
    to_client: int = 0  # chunks handed to the server for the client
    last_from_engine: float | None = None
    last_to_client: float | None = None
    ticket: Ticket | None = None
    engine_answering: bool = False
    closed: bool = False

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def route(self) -> str:
        return self.rec.route

    @property
    def stream(self) -> bool:
        return self.rec.stream

    # -- where it is ------------------------------------------------------------------------

    def enter(self, phase: str) -> None:
        assert phase in PHASES, phase
        self.phase = phase

    def received(self) -> None:
        self.from_engine += 1
        self.last_from_engine = time.monotonic()

    def sent(self) -> None:
        self.to_client += 1
        self.last_to_client = time.monotonic()

    def view(self, now: float) -> dict[str, Any]:
        def ago(t: float | None) -> float | None:
            return None if t is None else round(now - t, 3)

        return {"id": self.id, "route": self.route, "class": self.cls, "stream": self.stream,
                "phase": self.phase, "age_s": round(now - self.started, 3),
                "chunks_from_engine": self.from_engine, "chunks_to_client": self.to_client,
                "since_engine_s": ago(self.last_from_engine), "since_client_s": ago(self.last_to_client)}

    # -- the engine's part ------------------------------------------------------------------

    def hold(self, ticket: Ticket | None) -> None:
        """The local engine answers it from now on, in the admission slot `ticket` (None: admission off)."""
        self.ticket = ticket
        self.engine_answering = True
        self.owner.answering(self)

    def release(self) -> None:
        """The engine is done with it: the slot goes back and a drain stops waiting for it. Idempotent."""
        if self.engine_answering:
            self.engine_answering = False
            self.owner.released(self)
        self.ticket = None

    # -- its ending ------------------------------------------------------------------------

    def close(self, status: int | None = None, code: str | None = None) -> None:
        """The request is over: released, off the in-flight view, counted and logged, exactly once.
        `status`/`code` set the outcome when given (else the one the answer set)."""
        if self.closed:
            return
        self.closed = True
        if status is not None:
            self.rec.status, self.rec.error_code = status, code
        self.release()
        self.rec.total_ms = (time.perf_counter() - self.t0) * 1000
        self.owner.closed(self)

    def refused(self, error: ApiError) -> ApiError:
        """It ends with `error` (the caller raises it), which carries the request's id."""
        self.close(error.status, error.code)
        error.headers.setdefault("X-Request-Id", self.id)
        return error

    def gone(self, status: int = 499, code: str = "client_disconnected") -> Response:
        """The connection ended before an answer: 499 (nginx's "client closed request") when the client
        left, or the status the connection layer already sent. Nobody reads this response; the request
        log says what happened."""
        self.close(status, code)
        return Response(status_code=status)

    def answered(self, status: int, content: bytes, headers: dict[str, str],
                 media_type: str = "application/json", engine: bool = True) -> Response:
        """A whole answer: usage (and text, when kept) taken for the log, an engine's error re-shaped to
        OpenAI's (`engine`: the body is the engine's own), closed once the response is sent."""
        rec = self.rec
        rec.status = status
        if status == 200:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                data = json.loads(content)
                take_usage(rec, self.dialect.usage_of(data))
                if rec.prompt is not None:
                    rec.completion = self.dialect.text_of(data, False)
        elif engine:
            content, rec.error_code = normalise_error(status, content, self.dialect.route)
        return ClosingResponse(content, self.close, status_code=status, media_type=media_type, headers=headers)


class ClosingResponse(Response):
    """A response that closes its exchange however the sending ends: sent, failed or cancelled."""

    def __init__(self, content: bytes, on_close: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Exchanges:
    """The open exchanges, oldest first, and the ones the local engine is answering."""

    def __init__(self, request_log: RequestLog | None, metrics: Metrics | None,
                 admission: AdmissionGate | None) -> None:
        self.request_log, self.metrics, self.admission = request_log, metrics, admission
        self._open: dict[int, Exchange] = {}
        self._answering: set[Exchange] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def keeps_text(self) -> bool:
        return self.request_log is not None and self.request_log.keep_text

    def open(self, rid: str, dialect: Dialect, cls: str, key: Any) -> Exchange:
        rec = RequestRecord(id=rid, ts=time.time(), route=dialect.route, model=None, status=0, stream=False,
                            key_id=key.id if key else None, extra={"class": cls})
        ex = Exchange(rec, time.perf_counter(), cls, key.tenant if key else None, self, dialect)
        self._open[id(ex)] = ex
        return ex

    def snapshot(self) -> list[dict[str, Any]]:
        """The routed requests not yet in the request log, oldest first."""
        now = time.monotonic()
        return [ex.view(now) for ex in sorted(self._open.values(), key=lambda e: e.started) if ex.phase]

    # -- the local engine's part: its drain count ----------------------------------------------

    @property
    def engine_answering(self) -> int:
        return len(self._answering)

    async def drained(self, timeout: float) -> int:
        """Wait until the local engine answers no request, at most `timeout` s; returns how many still run."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return len(self._answering)

    def answering_now(self) -> set[Exchange]:
        """The requests the local engine answers at this instant (an upgrade's switch keeps them)."""
        return set(self._answering)

    async def drained_of(self, these: set[Exchange], timeout: float) -> int:
        """Wait until none of `these` is answered by the engine any more, at most `timeout` s; returns how
        many still are."""
        deadline = time.monotonic() + timeout
        while (left := these & self._answering) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return len(left)

    def answering(self, ex: Exchange) -> None:
        self._answering.add(ex)
        self._idle.clear()

    def released(self, ex: Exchange) -> None:
        self._answering.discard(ex)
        if ex.ticket is not None and self.admission is not None:
            self.admission.release(ex.ticket)
        if not self._answering:
            self._idle.set()

    def closed(self, ex: Exchange) -> None:
        self._open.pop(id(ex), None)
        if self.metrics is not None:
            self.metrics.observe_request(ex.rec, ex.cls)
        if self.request_log is not None:
            self.request_log.record(ex.rec)
