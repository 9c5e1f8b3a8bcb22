"""Forwarding OpenAI requests to the private vLLM port.

Streams are passed through event by event as they arrive (never buffered
whole). For streams the appliance always asks vLLM for the final usage event,
so the request log has token counts, and removes that event again when the
client did not ask for it. A client that goes away closes the upstream
connection, which makes vLLM abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from appliance.admission import AdmissionGate, AdmissionRejected, Ticket
from appliance.admission import Request as AdmissionRequest
from appliance.api import answers
from appliance.api.errors import ApiError, error_body
from appliance.api.inflight import Flight, InFlight
from appliance.api.schemas import validate_body
from appliance.engine.supervisor import EngineState, EngineSupervisor
from appliance.metrics import Metrics
from appliance.store import RequestLog, RequestRecord
from cascade import signals
from cascade.policy import Decision, PolicyError, RequestFacts, parse_headers
from cascade.service import Cascade, EscalationResult

log = logging.getLogger(__name__)

_USAGE_MARK = b'"usage":{'
_EMPTY_CHOICES = b'"choices":[]'
_DONE = b"data: [DONE]"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class GatewaySettings:
    served_name: str
    max_body_bytes: int
    retry_after_s: int
    upstream_timeout_s: float
    default_class: str = "silver"  # the priority class of a request without a key


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class EngineProxy:
    def __init__(self, supervisor: EngineSupervisor, settings: GatewaySettings, request_log: RequestLog | None,
                 metrics: Metrics | None = None, admission: AdmissionGate | None = None,
                 cascade: Cascade | None = None) -> None:
        self.supervisor = supervisor
        self.admission = admission
        self.cascade = cascade
        self.settings = settings
        self.request_log = request_log
        self.metrics = metrics
        # One pooled client for the daemon's lifetime: keep-alive connections to the engine
        # save a TCP handshake per request.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=5.0, pool=settings.upstream_timeout_s),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )
        # The requests the local engine is answering, so a planned relaunch can let them finish (drained).
        self._local: set[_Lease] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = InFlight()  # every generation request from its job to its request-log entry

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def local_in_flight(self) -> int:
        return len(self._local)

    async def drained(self, timeout: float) -> int:
        """Wait until the local engine answers no request, at most `timeout` s; returns how many still run."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return len(self._local)

    def _lease(self, ticket: Ticket | None) -> "_Lease":
        lease = _Lease(ticket, self._end_lease)
        self._local.add(lease)
        self._idle.clear()
        return lease

    def _end_lease(self, lease: "_Lease") -> None:
        self._local.discard(lease)
        self._release(lease.ticket)
        if not self._local:
            self._idle.set()

    # -- checks ---------------------------------------------------------------------------

    def require_ready(self) -> str:
        st = self.supervisor.status
        base = self.supervisor.base_url
        if st.state is not EngineState.READY or base is None:
            what = {
                EngineState.STARTING: "the engine is loading the model",
                EngineState.RESTARTING: "the engine is restarting",
                EngineState.FAILED: "the engine has failed and the appliance gave up restarting it",
                EngineState.STOPPING: "the appliance is stopping",
            }.get(st.state, "the engine is not running")
            raise ApiError(
                503,
                f"{what} ({st.reason}); retry later",
                code="engine_not_ready",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        return base

    async def read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw:
            raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None

    def check_model(self, model: str, decision: Decision | None = None) -> None:
        if decision is not None and decision.action == "refuse":
            status, code = (404, "model_not_found") if "no regional endpoint" in decision.reason else \
                (403, "escalation_forbidden")
            raise ApiError(status, f"the model '{model}' cannot be served here: {decision.reason}", code=code,
                           param="model")
        if model != self.settings.served_name and not (self.cascade and self.cascade.serves_regionally(model)):
            raise ApiError(
                404,
                f"the model '{model}' does not exist here; this appliance serves '{self.settings.served_name}'",
                code="model_not_found",
                param="model",
            )

    # -- routes ---------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        base = self.require_ready()
        try:
            r = await self.client.get(f"{base}/v1/models", headers=self._auth())
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    def _unreachable(self, e: Exception) -> ApiError:
        return ApiError(503, f"the engine did not answer ({type(e).__name__}); retry later", code="engine_unreachable",
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    async def generate(self, request: Request, route: str, schema: type) -> Response:
        # A client's id is kept when it is a plain token; anything else (it reaches vLLM and the logs) is replaced.
        given = request.headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.fullmatch(given) else new_request_id()
        t0 = time.perf_counter()
        key = request.scope.get("state", {}).get("api_key")
        key_id = key.id if key else None
        cls = key.priority_class if key else self.settings.default_class
        extra = {"class": cls}
        body: Any = None
        try:
            body = await self.read_json(request)
            parsed = validate_body(schema, body)
            prompt_tokens, max_tokens = _estimate_tokens(body), _max_tokens(parsed)
            decision = self._decide(request, parsed.model, prompt_tokens, max_tokens, key)
            self.check_model(parsed.model, decision)
            base = self._engine_or_regional(decision)
        except ApiError as e:
            model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
            self._record(RequestRecord(id=rid, ts=time.time(), route=route, model=model, status=e.status,
                                       stream=False, error_code=e.code, key_id=key_id, extra=extra), t0)
            e.headers.setdefault("X-Request-Id", rid)
            raise

        stream = bool(parsed.stream)
        client_wants_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        rec = RequestRecord(
            id=rid, ts=time.time(), route=route, model=parsed.model, status=0, stream=stream, key_id=key_id, extra=extra,
            prompt=_prompt_text(body) if self.request_log and self.request_log.keep_text else None,
        )
        job = _Job(rec=rec, t0=t0, body=body, original=dict(body), stream=stream,
                   client_wants_usage=client_wants_usage, cls=cls, tenant=key.tenant if key else None,
                   decision=decision, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                   flight=self.inflight.start(rec, Flight(rid, route, cls, stream)))
        try:
            return await self._route(request, job, base)
        except BaseException:
            self.inflight.end(rec)  # whatever the error, the request is over
            raise

    async def _route(self, request: Request, job: "_Job", base: str | None) -> Response:
        decision = job.decision
        if base is None:
            return await self._answer_regionally(request, job, base)
        if decision is not None and decision.action == "escalate_now":
            if decision.mode == "sync" or job.rec.model != self.settings.served_name:
                return await self._answer_regionally(request, job, base)
            job.escalation = await self._escalate(job, sync=False, reason=decision.reason)
        elif decision is not None and decision.action == "local_then_judge":
            job.judge = True
            job.client_wants_logprobs = answers.request_logprobs(job.body, chat=job.rec.route == "/v1/chat/completions")
        if self.cascade is not None:
            self.cascade.count("local")
        return await self._answer_locally(request, job, base)

    def _decide(self, request: Request, model: str, prompt_tokens: int, max_tokens: int | None,
                key: Any) -> Decision | None:
        if self.cascade is None:
            return None
        try:
            header_escalate, header_mode, local_only = parse_headers(dict(request.headers))
        except PolicyError as e:
            raise ApiError(400, str(e), code="invalid_header", param=e.param) from None
        return self.cascade.decide(RequestFacts(
            model=model, tenant=key.tenant if key else None, header_escalate=header_escalate,
            header_mode=header_mode, local_only_header=local_only, prompt_tokens=prompt_tokens,
            max_tokens=max_tokens))

    def _engine_or_regional(self, decision: Decision | None) -> str | None:
        """The engine's address; None when the answer comes from the regional cluster instead (a model
        only it serves, or the local engine down while the policy allows escalation)."""
        if decision is not None and decision.action == "escalate_now" and decision.mode == "sync":
            return self.supervisor.base_url if self.supervisor.ready else None
        try:
            return self.require_ready()
        except ApiError:
            if decision is not None and decision.may_escalate and self.cascade and self.cascade.link_usable:
                return None  # self-healing: while the engine restarts, the regional cluster answers
            raise

    async def _escalate(self, job: "_Job", sync: bool, reason: str) -> EscalationResult:
        assert self.cascade is not None
        key_id = job.rec.key_id
        return await self.cascade.escalate(
            job.rec.route, job.original, sync=sync, priority_class=job.cls, tenant=job.tenant, key_id=key_id,
            reason=reason, keep_model=job.rec.model != self.settings.served_name)

    async def _answer_regionally(self, request: Request, job: "_Job", base: str | None) -> Response:
        """Sync escalation: the regional answer when the link delivers it; else the local one, marked."""
        rec, decision = job.rec, job.decision
        assert decision is not None and self.cascade is not None
        reason = decision.reason if decision.action == "escalate_now" else "the local engine is not ready"
        job.flight.enter("regional")
        result = await self._escalate(job, sync=True, reason=reason)
        job.escalation = result
        if result.outcome == "answered" and result.answer is not None:
            headers = {"X-Request-Id": rec.id, **answers.headers_for(result, reason, "regional")}
            rec.status = 200
            _take_usage(rec, result.answer.body.get("usage"))
            self._record(rec, job.t0)
            if job.stream:
                return Response(answers.as_stream(result.answer.body, job.client_wants_usage), status_code=200,
                                media_type="text/event-stream", headers=headers)
            return Response(json.dumps(result.answer.body).encode(), status_code=200,
                            media_type="application/json", headers=headers)
        local_possible = base is not None and rec.model == self.settings.served_name
        if local_possible:
            self.cascade.count("fallback")
            assert base is not None
            return await self._answer_locally(request, job, base)
        rec.status, rec.error_code = 503, "regional_unavailable"
        self._record(rec, job.t0)
        where = f"; it is queued as {result.id} (GET /v1/escalations/{result.id})" if result.outcome == "queued" else ""
        raise ApiError(503, f"the regional cluster could not answer ({result.error or result.outcome}){where}",
                       code="regional_unavailable",
                       headers={"Retry-After": str(self.settings.retry_after_s), "X-Request-Id": rec.id,
                                **answers.headers_for(result, reason, "none")})

    async def _answer_locally(self, request: Request, job: "_Job", base: str) -> Response:
        rec, body = job.rec, job.body
        if job.stream and not job.client_wants_usage:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body["stream_options"] = opts
        job.flight.enter("admission")
        try:
            ticket = await self._admit(request, AdmissionRequest(job.cls, job.prompt_tokens, job.max_tokens))
        except ApiError as e:
            rec.status, rec.error_code = e.status, e.code
            self._record(rec, job.t0)
            e.headers.setdefault("X-Request-Id", rec.id)
            raise
        except _ClientGone:
            return self._client_gone(rec, job.t0)
        admitted = time.perf_counter()
        lease = self._lease(ticket)
        try:
            return await self._forward(request, base, job, lease, admitted)
        except BaseException:
            lease.end()
            raise

    async def _admit(self, request: Request, req: AdmissionRequest) -> Ticket | None:
        if self.admission is None:
            return None
        try:
            return await _race_disconnect(request, self.admission.acquire(req), discard=self._release_async)
        except AdmissionRejected as e:
            v = e.verdict
            headers = {"Retry-After": str(v.retry_after_s)} if v.retry_after_s else {}
            raise ApiError(v.status, v.message, code=v.code, param="max_tokens" if v.status == 400 else None,
                           headers=headers) from None

    def _release(self, ticket: Ticket | None) -> None:
        if ticket is not None and self.admission is not None:
            self.admission.release(ticket)

    async def _release_async(self, ticket: Ticket) -> None:
        self._release(ticket)

    async def _forward(self, request: Request, base: str, job: "_Job", lease: "_Lease",
                       admitted: float) -> Response:
        rec, t0, body = job.rec, job.t0, job.body
        upstream_req = self.client.build_request(
            "POST", f"{base}{rec.route}", content=json.dumps(body).encode(), headers=self._auth(rec.id)
        )
        job.flight.enter("engine")
        try:
            upstream = await self._send_watching_disconnect(request, upstream_req)
        except _ClientGone:
            lease.end()
            return self._client_gone(rec, t0)
        except httpx.HTTPError as e:
            lease.end()
            rec.status, rec.error_code = 503, "engine_unreachable"
            self._record(rec, t0)
            raise self._unreachable(e) from None

        headers = {"X-Request-Id": rec.id}
        if job.decision is not None:
            headers.update(answers.headers_for(job.escalation, job.decision.reason, "local"))
        if upstream.status_code != 200 or not job.stream:
            job.flight.enter("reading")
            try:
                content = await self._read_watching_disconnect(request, upstream)
            except _ClientGone:
                return self._client_gone(rec, t0)
            except httpx.HTTPError:
                content = json.dumps(error_body("the engine broke off its answer", "server_error", None,
                                                "engine_error")).encode()
                return self._finish_plain(rec, t0, 502, content, headers)
            finally:
                lease.end()
            if job.judge and upstream.status_code == 200:
                return await self._judged(job, content, headers)
            return self._finish_plain(rec, t0, upstream.status_code, content, headers)

        rec.status = 200
        job.flight.enter("streaming")

        def first_token() -> None:
            if self.admission is not None:
                self.admission.observe_prefill(job.prompt_tokens, time.perf_counter() - admitted)

        async def on_close() -> None:
            # Runs however the response ends, even when the client left before the relay started
            # (then the generator never ran and only this closes the upstream and frees the slot).
            lease.end()
            self.inflight.end(rec)  # normally gone already (the request log's entry); not when the send failed
            await upstream.aclose()

        return _ClosingStream(
            self._relay(upstream, rec, t0, strip_usage=not job.client_wants_usage, flight=job.flight,
                        on_first=first_token, judge=self._stream_judge(job) if job.judge else None),
            on_close=on_close,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(self._record_after_response, rec, t0),
        )

    async def _judged(self, job: "_Job", content: bytes, headers: dict[str, str]) -> Response:
        """Auto policy, non-streamed: judge the local answer; escalate it when the signals say so."""
        assert self.cascade is not None and job.decision is not None
        try:
            data = json.loads(content)
        except ValueError:
            return self._finish_plain(job.rec, job.t0, 200, content, headers)
        escalate, why, sig = self.cascade.judge(signals.from_response(data))
        if not job.client_wants_logprobs:
            answers.hide_logprobs(data)
        local = json.dumps(data).encode()
        if not escalate:
            headers[answers.ESCALATION] = "none"
            headers[answers.ESCALATION_REASON] = why
            return self._finish_plain(job.rec, job.t0, 200, local, headers)
        sync = job.decision.mode == "sync"
        result = await self._escalate(job, sync=sync, reason=f"low confidence: {why}")
        if result.outcome == "answered" and result.answer is not None:
            headers.update(answers.headers_for(result, f"low confidence: {why}", "regional"))
            return self._finish_plain(job.rec, job.t0, 200, json.dumps(result.answer.body).encode(), headers)
        headers.update(answers.headers_for(result, f"low confidence: {why}", "local"))
        return self._finish_plain(job.rec, job.t0, 200, local, headers)

    def _stream_judge(self, job: "_Job") -> "_StreamJudge":
        async def after(tl: signals.TokenLogprobs) -> bytes:
            assert self.cascade is not None
            escalate, why, _ = self.cascade.judge(tl)
            if not escalate:
                return b""
            # The answer has been streamed already: the escalation is queued (async) whatever the mode.
            result = await self._escalate(job, sync=False, reason=f"low confidence: {why}")
            if result.id:
                return answers.sse_comment(f"appliance-escalation-id={result.id} reason={why}")
            return answers.sse_comment(f"appliance-escalation={result.outcome} reason={why}")

        return _StreamJudge(hide=not job.client_wants_logprobs, after=after)

    # -- plumbing -------------------------------------------------------------------------

    def _auth(self, rid: str | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.supervisor.internal_key}", "Content-Type": "application/json"}
        if rid:
            h["X-Request-Id"] = rid
        return h

    async def _send_watching_disconnect(self, request: Request, upstream_req: httpx.Request) -> httpx.Response:
        return await _race_disconnect(request, self.client.send(upstream_req, stream=True))

    async def _read_watching_disconnect(self, request: Request, upstream: httpx.Response) -> bytes:
        try:
            return await _race_disconnect(request, upstream.aread())
        finally:
            await upstream.aclose()

    def _finish_plain(self, rec: RequestRecord, t0: float, status: int, content: bytes, headers: dict) -> Response:
        rec.status = status
        if status == 200:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                data = json.loads(content)
                _take_usage(rec, data.get("usage"))
                if rec.prompt is not None:
                    rec.completion = _completion_text(data)
        else:
            content, rec.error_code = _normalise_error(status, content)
        media = "application/json"
        return Response(content, status_code=status, media_type=media, headers=headers,
                        background=BackgroundTask(self._record_after_response, rec, t0))

    async def _relay(self, upstream: httpx.Response, rec: RequestRecord, t0: float, strip_usage: bool,
                     flight: Flight, on_first: Callable[[], None] = lambda: None,
                     judge: "_StreamJudge | None" = None) -> AsyncIterator[bytes]:
        buf = b""
        texts: list[str] | None = [] if rec.prompt is not None else None
        try:
            async for chunk in upstream.aiter_raw():
                flight.received()
                if rec.ttft_ms is None:
                    rec.ttft_ms = (time.perf_counter() - t0) * 1000
                    on_first()
                buf += chunk
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    continue
                ready, buf = buf[: cut + 2], buf[cut + 2 :]
                if _USAGE_MARK in ready or texts is not None or judge is not None:
                    ready = self._inspect_events(ready, rec, strip_usage, texts, judge)
                if judge is not None and _DONE in ready:
                    # The answer is complete: judge it before the client sees the end of the stream.
                    head, tail = ready.split(_DONE, 1)
                    ready = head + await judge.after(judge.acc.result()) + _DONE + tail
                if ready:
                    yield ready
                    flight.sent()
            if buf:
                yield buf
        except httpx.HTTPError as e:
            # The engine went away mid-answer: end the stream with an error event the
            # OpenAI client raises on, instead of a silent truncation.
            rec.status, rec.error_code = 502, "engine_stream_broken"
            log.warning("stream %s broke off: %s", rec.id, type(e).__name__, extra={"REQUEST_ID": rec.id})
            err = error_body("the engine stopped while streaming this answer; retry", "server_error", None,
                             "engine_stream_broken")
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        except asyncio.CancelledError:
            rec.status, rec.error_code = 499, "client_disconnected"
            raise
        finally:
            # Closing an unfinished upstream stream drops the connection: vLLM aborts the request.
            await upstream.aclose()
            if texts is not None:
                rec.completion = "".join(texts)

    @staticmethod
    def _inspect_events(ready: bytes, rec: RequestRecord, strip_usage: bool, texts: list[str] | None,
                        judge: "_StreamJudge | None" = None) -> bytes:
        kept: list[bytes] = []
        for event in ready.split(b"\n\n"):
            if not event:
                continue
            if event.startswith(b"data: {"):
                is_usage = _USAGE_MARK in event
                if is_usage or texts is not None or judge is not None:
                    with contextlib.suppress(ValueError):
                        data = json.loads(event[6:])
                        if is_usage:
                            _take_usage(rec, data.get("usage"))
                        if texts is not None:
                            texts.append(_completion_text(data, delta=True))
                        if judge is not None:
                            judge.acc.add_chunk(data)
                            if judge.hide:
                                answers.hide_logprobs(data)
                                event = b"data: " + json.dumps(data).encode()
                if is_usage and strip_usage and _EMPTY_CHOICES in event:
                    continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def _client_gone(self, rec: RequestRecord, t0: float) -> Response:
        # 499 (nginx's "client closed request"): nobody reads it, but the request log says what happened.
        rec.status, rec.error_code = 499, "client_disconnected"
        self._record(rec, t0)
        return Response(status_code=499)

    async def _record_after_response(self, rec: RequestRecord, t0: float) -> None:
        # async on purpose: Starlette runs a plain-function background task in a worker thread,
        # a thread hop per request for what is only a queue put.
        self._record(rec, t0)

    def _record(self, rec: RequestRecord, t0: float) -> None:
        self.inflight.end(rec)
        rec.total_ms = (time.perf_counter() - t0) * 1000
        if self.metrics is not None:
            self.metrics.observe_request(rec, rec.extra.get("class"))
        if self.request_log is not None:
            self.request_log.record(rec)


class _ClientGone(Exception):
    pass


@dataclass(eq=False)
class _Lease:
    """A request the local engine is answering: its admission slot and its place in the drain count."""

    ticket: Ticket | None
    _on_end: Callable[["_Lease"], None]
    ended: bool = False

    def end(self) -> None:  # idempotent: every way a response can finish calls it
        if not self.ended:
            self.ended = True
            self._on_end(self)


@dataclass
class _Job:
    """One generation request on its way through the gateway."""

    rec: RequestRecord
    t0: float
    body: dict  # what goes to the engine (the gateway adds usage and log-probability requests) ...
    original: dict  # ... and what the client sent, which is what an escalation forwards
    stream: bool
    client_wants_usage: bool
    cls: str
    tenant: str | None
    decision: Decision | None
    prompt_tokens: int  # estimated once (see _estimate_tokens) for the policy, admission and prefill speed
    max_tokens: int | None
    flight: Flight  # its line in GET /v1/appliance/requests until the request log has it
    judge: bool = False  # auto policy: judge the local answer's confidence
    client_wants_logprobs: bool = False
    escalation: EscalationResult | None = None


@dataclass
class _StreamJudge:
    hide: bool  # the client did not ask for log-probabilities: remove them from every chunk
    after: Callable[[signals.TokenLogprobs], Awaitable[bytes]]
    acc: signals.StreamAccumulator = field(default_factory=signals.StreamAccumulator)


class _ClosingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: finished, failed or cancelled."""

    def __init__(self, content: Any, *, on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _close_response(res: httpx.Response) -> None:
    await res.aclose()


async def _race_disconnect(request: Request, work: Any,
                           discard: Callable[[Any], Awaitable[None]] = _close_response) -> Any:
    """Run `work` unless the client disconnects first; then cancel it, and `discard` a result that
    arrived anyway (an upstream response to close, an admission slot to give back)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError, AdmissionRejected):
            res = await task
            if res is not None:
                await discard(res)
        raise _ClientGone()
    finally:
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _estimate_tokens(body: dict) -> int:
    """About four bytes of text per token: admission only needs the order of magnitude, and
    tokenizing at the gateway would cost a round trip to the engine per request."""
    return max(1, len(_prompt_text(body).encode()) // 4)


def _max_tokens(parsed: Any) -> int | None:
    return getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens


def _take_usage(rec: RequestRecord, usage: Any) -> None:
    if isinstance(usage, dict):
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")


def _prompt_text(body: dict) -> str:
    if "messages" in body:
        return json.dumps(body["messages"], ensure_ascii=False)
    p = body.get("prompt")
    return p if isinstance(p, str) else json.dumps(p)


def _completion_text(data: dict, delta: bool = False) -> str:
    out = []
    for c in data.get("choices") or []:
        if delta:
            out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
        else:
            out.append((c.get("message") or {}).get("content") or c.get("text") or "")
    return "".join(out)


def _normalise_error(status: int, content: bytes) -> tuple[bytes, str | None]:
    """Re-shape the engine's error into the OpenAI body with an OpenAI error type.

    vLLM answers {"error": {"message", "type": "BadRequestError", "param", "code": 400}}:
    the right idea with a Python class name for the type and the status as the code.
    Clients switch on `type` and `code`, so those are mapped; message and param are kept.
    """
    message, param, code = None, None, None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        data = json.loads(content)
        err = data.get("error") if isinstance(data.get("error"), dict) else data
        if isinstance(err.get("message"), str):
            message, param = err["message"], err.get("param")
            code = err.get("code") if isinstance(err.get("code"), str) else None
    if message is None:
        message = f"the engine answered {status}: {content.decode('utf-8', 'replace')[:500]}"
    code = code or ("engine_rejected" if status < 500 else "engine_error")
    body = ApiError(status, message, code=code, param=param if isinstance(param, str) else None).body()
    return json.dumps(body).encode(), code
