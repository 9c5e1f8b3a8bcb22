"""The gateway: an OpenAI request in, the local engine's (or the regional cluster's) answer out.

It composes the rooms beside it: intake (body, id, estimates), route_choice and routing (where it is
answered: policy, regional answers, judging), admission (a slot per request, by priority class), the
splice (local streams) and disconnect handling. Each request is one `Exchange` (appliance.api.exchange),
which owns its ending: whatever way `generate` leaves, the exchange is closed exactly once.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from appliance.api import answers
from appliance.api.admission import AdmissionGate, AdmissionRejected, Ticket
from appliance.api.admission import Request as AdmissionRequest
from appliance.api.dialects import Dialect
from appliance.api.disconnect import ClientGone, race_disconnect, read_or_leave
from appliance.api.engine_stream import EngineLinkError, EngineRefused, EngineStream
from appliance.api.errors import ApiError, error_body, normalise_error, retry_later
from appliance.api.exchange import Exchange, Exchanges
from appliance.api.http_protocol import BODY_TIMED_OUT
from appliance.api.intake import body_model, estimate_tokens, max_tokens, read_json, request_id
from appliance.api.relay import EventFilter, refused_at_start
from appliance.api.route_choice import Local, Refuse, Regional, Route, choose_route
from appliance.api.routing import Routing
from appliance.api.schemas import validate_body
from appliance.api.splice import SplicedStream
from appliance.engine.supervisor import EngineState, EngineSupervisor
from appliance.ops.metrics import Metrics
from appliance.store.requests import RequestLog
from cascade.policy import PRIORITY_CLASSES
from cascade.service import Cascade

log = logging.getLogger(__name__)

_ENGINE_BROKE_OFF = json.dumps(error_body("the engine broke off its answer", "server_error", None,
                                          "engine_error")).encode()


async def _keep(_: object) -> None:
    """A chunk read after the client left needs no closing (the upstream is closed on its own)."""

_CONNECT_S = 5.0

_NOT_READY = {
    EngineState.STARTING: "the engine is loading the model",
    EngineState.RESTARTING: "the engine is restarting",
    EngineState.FAILED: "the engine has failed and the appliance gave up restarting it",
    EngineState.STOPPING: "the appliance is stopping",
}


@dataclass(frozen=True)
class GatewaySettings:
    served_name: str
    max_body_bytes: int
    retry_after_s: int
    upstream_timeout_s: float
    default_class: str = "silver"  # the priority class of a request without a key
    max_choices: int = 4  # largest n / best_of: the sequences one request may run in the engine
    engine_socket: Path | None = None  # the engine's Unix socket (unset only in tests that never reach it)
    # The plan's word on tool_choice "auto" (kvbudget.tools): False where the chat template does not show
    # the model its tools, and such a request is refused rather than answered as if no tools were given.
    auto_tool_choice: bool = True
    # While the engine restarts, a request that cannot go regionally waits this long for it (its class's
    # own bound first), at most restart_hold_max requests at once; 0: refused with 503 at once.
    restart_hold_s: float = 0.0
    restart_hold_max: int = 0
    class_restart_hold_s: Mapping[str, float] = dataclass_field(default_factory=dict)
    upgrade_hold_s: float = 0.0  # while an upgrade's new engine loads in place: the hold, when longer


class Gateway:
    def __init__(self, supervisor: EngineSupervisor, settings: GatewaySettings, request_log: RequestLog | None,
                 metrics: Metrics | None = None, admission: AdmissionGate | None = None,
                 cascade: Cascade | None = None) -> None:
        self.supervisor = supervisor
        self.admission = admission
        self.cascade = cascade
        self.settings = settings
        self.metrics = metrics
        self.exchanges = Exchanges(request_log, metrics, admission)
        self.routing = Routing(cascade, settings.served_name, settings.retry_after_s)
        self.held = 0  # requests waiting now for the engine to come back
        # The engine's only way in (appliance.engine.args) is its private Unix socket. Generation requests,
        # the hot path, go over a protocol of our own (appliance.api.engine_stream says why); the model
        # list over one pooled httpx client (no TLS there, so verify=False: no CA bundle parsed for nothing).
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=8)
        transport = (httpx.AsyncHTTPTransport(uds=str(settings.engine_socket), limits=limits, verify=False)
                     if settings.engine_socket is not None else None)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=5.0, pool=settings.upstream_timeout_s),
            limits=limits, transport=transport)

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def local_in_flight(self) -> int:
        """Requests the local engine is answering now."""
        return self.exchanges.engine_answering

    async def drained(self, timeout: float) -> int:
        """Wait until the local engine answers no request, at most `timeout` s; returns how many still run."""
        return await self.exchanges.drained(timeout)

    # -- routes ---------------------------------------------------------------------------

    def require_ready(self) -> str:
        """The engine's address, or 503 with Retry-After saying why it cannot answer now."""
        st = self.supervisor.status
        base = self.supervisor.base_url
        if st.state is not EngineState.READY or base is None:
            what = _NOT_READY.get(st.state, "the engine is not running")
            raise retry_later(503, f"{what} ({st.reason}); retry later", "engine_not_ready",
                              self.settings.retry_after_s)
        return base

    async def list_models(self, request: Request) -> Response:
        base = self.require_ready()
        try:
            r = await self.client.get(f"{base}/v1/models", headers=self._auth())
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def retrieve_model(self, request: Request, model_id: str) -> Response:
        """GET /v1/models/{id} (the SDKs' models.retrieve), which vLLM does not serve: the entry of the
        engine's own list with that id, or OpenAI's 404."""
        listed = await self.list_models(request)
        if listed.status_code != 200:
            return listed
        try:
            entries = json.loads(bytes(listed.body))["data"]
        except (ValueError, KeyError, TypeError):
            raise ApiError(502, "the engine's model list could not be read", code="engine_bad_response") from None
        for entry in entries:
            if isinstance(entry, dict) and entry.get("id") == model_id:
                return Response(json.dumps(entry).encode(), media_type="application/json")
        raise ApiError(404, f"the model '{model_id}' does not exist here; this appliance serves "
                            f"'{self.settings.served_name}'", code="model_not_found", param="model")

    async def pass_through(self, request: Request, path: str, with_body: bool = True) -> Response:
        """A route the engine answers at once without generating (Anthropic's count_tokens; a stored
        response's retrieval or cancellation, of which this appliance keeps none: docs/http-api.md): the
        body checked like a generation's, passed on, and an error in the route's shape."""
        base = self.require_ready()
        content = json.dumps(await read_json(request, self.settings.max_body_bytes)).encode() if with_body else None
        try:
            r = await self.client.request(request.method, f"{base}{path}", content=content,
                                          headers=self._auth(request_id(request)))
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if r.status_code != 200:
            shaped, _ = normalise_error(r.status_code, r.content, path)
            return Response(shaped, status_code=r.status_code, media_type="application/json")
        return Response(r.content, media_type="application/json")

    async def generate(self, request: Request, dialect: Dialect) -> Response:
        """One generation request, start to end: every way out of here closes its exchange once."""
        key = request.scope.get("state", {}).get("api_key")
        cls = key.priority_class if key else self.settings.default_class
        ex = self.exchanges.open(request_id(request), dialect, cls, key)
        try:
            return await self._generate(request, ex)
        except ApiError as e:
            raise ex.refused(e) from None
        except ClientGone:
            return ex.gone()
        except ClientDisconnect:  # left while sending the body: theirs to end, not a fault of ours
            if request.scope.get("state", {}).get(BODY_TIMED_OUT):  # the connection layer ended it: 408 sent
                return ex.gone(408, "body_timeout")
            return ex.gone()
        except Exception as e:
            # A fault of the gateway's own: one log record with its traceback, the request in the
            # metrics and the request log like any other, and an OpenAI-style 500 on a connection that
            # stays open (an exception left to Starlette is logged twice and closes it).
            log.exception("request %s: %s in the gateway", ex.id, type(e).__name__, extra={"REQUEST_ID": ex.id})
            if self.metrics is not None:
                self.metrics.observe_fault(dialect.route)
            raise ex.refused(ApiError(500, f"internal error in the appliance (request {ex.id}); its log has the "
                                           "details", code="internal_error")) from None
        except BaseException:  # cancelled: the server is stopping, or the client left mid-await
            ex.close(499, "client_disconnected")
            raise

    async def _generate(self, request: Request, ex: Exchange) -> Response:
        rec, dialect = ex.rec, ex.dialect
        body: Any = None
        try:
            body = await read_json(request, self.settings.max_body_bytes)
            parsed = validate_body(dialect.schema, body)
        finally:
            rec.model = body_model(body)  # for the request log, also of a refused request
        if not self.settings.auto_tool_choice and dialect.auto_tools(body):
            raise ApiError(400, "tool_choice \"auto\" cannot call tools with this model: its chat template does not "
                                "show it the tools (`appliance plan` says so). Name the tool (OpenAI: tool_choice="
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}; Anthropic: {\"type\": "
                                "\"tool\", \"name\": ...}) or ask for any (\"required\"; Anthropic: {\"type\": "
                                "\"any\"}): those are decoded under the tool's schema", code="tool_choice_unsupported",
                           param="tool_choice")
        text = dialect.prompt_text(body)  # once: for the estimate and, when kept, the request log
        ex.prompt_tokens, ex.max_tokens = estimate_tokens(text), max_tokens(parsed)
        ex.seqs = self._sequences(parsed)
        limit = self._class_token_limit(ex.cls)
        if ex.max_tokens is None and limit is not None:
            # Left out or null means "as many as the context allows" to the engine: the class limit
            # applies to that too, so the engine is told it.
            body[dialect.limit_field] = ex.max_tokens = limit
        ex.decision = self.routing.decide(request.headers, parsed.model, ex.prompt_tokens, ex.max_tokens,
                                          ex.tenant)

        def route(engine_refusal: ApiError | None) -> Route:
            return choose_route(ex.decision, model=parsed.model, served_name=self.settings.served_name,
                                serves_regionally=self.routing.serves_regionally(parsed.model),
                                engine_refusal=engine_refusal, link_usable=self.routing.link_usable,
                                escalable=dialect.cascade)

        refusal = self._engine_refusal()
        way = route(refusal)
        if isinstance(way, Refuse) and refusal is not None and way.error is refusal:
            await self._hold_while_restarting(request, ex)
            way = route(self._engine_refusal())  # on the engine's state now: back, or why it is not
        if isinstance(way, Refuse):
            raise way.error
        rec.model, rec.stream = parsed.model, bool(parsed.stream)
        if self.exchanges.keeps_text:
            rec.prompt = text
        ex.body, ex.original = body, dict(body)
        # Only where the engine takes stream_options is a usage event asked for (and stripped again).
        ex.client_wants_usage = not dialect.stream_usage or bool(parsed.stream_options and
                                                                 parsed.stream_options.include_usage)
        return await self._route(request, ex, way)

    async def _route(self, request: Request, ex: Exchange, way: Local | Regional) -> Response:
        match way:
            case Regional(fallback_local=fallback_local):
                answered = await self.routing.answer_regionally(ex, fallback_local)
                if answered is not None:
                    return answered
                return await self._answer_locally(request, ex)  # the link could not deliver: the fallback
            case Local(judge=judge, queue_escalation=queue_escalation):
                if queue_escalation:
                    assert ex.decision is not None
                    ex.escalation = await self.routing.escalate(ex, sync=False, reason=ex.decision.reason)
                if judge:
                    ex.judge = True
                    ex.client_wants_logprobs = answers.request_logprobs(
                        ex.body, chat=ex.route == "/v1/chat/completions")
                if self.cascade is not None:
                    self.cascade.count("local")
                return await self._answer_locally(request, ex)

    def _sequences(self, parsed: Any) -> int:
        """The sequences the engine runs for this request (n, or best_of when larger), within max_choices."""
        seqs = 1
        for field in ("n", "best_of"):
            value = getattr(parsed, field)
            if value is not None and value > self.settings.max_choices:
                raise ApiError(400, f"{field} is {value}; this appliance allows at most {self.settings.max_choices} "
                               "(server.max_choices)", code="too_many_choices", param=field)
            seqs = max(seqs, value or 1)
        return seqs

    def _class_token_limit(self, cls: str) -> int | None:
        if self.admission is None:
            return None
        policy = self.admission.cfg.classes.get(cls)
        return policy.max_tokens if policy is not None else None

    def _engine_refusal(self) -> ApiError | None:
        """The 503 the engine's state gives now, or None while it serves."""
        try:
            self.require_ready()
        except ApiError as e:
            return e
        return None

    async def _hold_while_restarting(self, request: Request, ex: Exchange) -> None:
        """Hold a request the engine cannot answer while it restarts, rather than refuse it: wait for it to
        serve again, up to the class's hold bound (GatewaySettings). No wait where there is no hold: a first
        start, a supervisor that gave up, a bound of 0, too many held. A client leaving is ClientGone."""
        hold = self.settings.class_restart_hold_s.get(ex.cls, self.settings.restart_hold_s)
        if self.supervisor.on_trial and hold > 0:  # a planned load and gate, longer than a restart
            hold = max(hold, self.settings.upgrade_hold_s)
        if hold <= 0 or not self.supervisor.coming_back:
            return
        if self.held >= self.settings.restart_hold_max:
            self._count_hold(ex.cls, "full")
            return
        ex.enter("held")
        self.held += 1
        try:
            back = await race_disconnect(request, self.supervisor.until_ready(hold), discard=_nothing)
        except ClientGone:
            self._count_hold(ex.cls, "left")
            raise
        finally:
            self.held -= 1
        self._count_hold(ex.cls, "served" if back else "timed_out" if self.supervisor.coming_back else "gave_up")

    def _count_hold(self, cls: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.holds.labels(cls, outcome).inc()

    async def _answer_locally(self, request: Request, ex: Exchange) -> Response:
        body = ex.body
        if ex.stream and not ex.client_wants_usage:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if self.admission is not None:
            # The class, not the client, sets the engine's priority (lower first); with admission on the
            # engine runs vLLM's priority scheduling (engine.args.with_admission).
            body["priority"] = PRIORITY_CLASSES.index(ex.cls)
        ex.enter("admission")
        ex.hold(await self._admit(request, AdmissionRequest(ex.cls, ex.prompt_tokens, ex.max_tokens, ex.seqs)))
        admitted = time.perf_counter()
        ex.enter("engine")
        data = json.dumps(body).encode()
        try:
            upstream, version = await race_disconnect(request, self._post(ex.route, data, ex.id))
        except EngineRefused as e:
            # The engine died and the supervisor has not said so yet: nothing was sent, so the request
            # waits for the restart like any held one, then goes again once.
            if not await self._wait_for_restart(request, ex):
                raise self._unreachable(e) from None
            upstream, version = await race_disconnect(request, self._post(ex.route, data, ex.id))
        headers = {"X-Request-Id": ex.id}
        if version:
            headers[answers.MODEL_DIGEST] = version
        if ex.ticket is not None:  # what admission expected: compare it with the first token's arrival
            headers[PREDICTED_TTFT] = str(round(ex.ticket.predicted_s * 1000))
        if ex.decision is not None:
            headers.update(answers.headers_for(ex.escalation, ex.decision.reason, "local"))
        if upstream.status_code != 200 or not ex.stream:
            return await self._answer_whole(request, upstream, ex, headers)
        return await self._answer_stream(request, upstream, ex, admitted, headers)

    async def _admit(self, request: Request, req: AdmissionRequest) -> Ticket | None:
        if self.admission is None:
            return None
        gate = self.admission
        try:
            now = gate.admit_now(req)
            if isinstance(now, Ticket):
                return now
            return await race_disconnect(request, gate.queue(req, now), discard=_give_back(gate))
        except AdmissionRejected as e:
            v = e.verdict
            headers = {"Retry-After": str(v.retry_after_s)} if v.retry_after_s else {}
            raise ApiError(v.status, v.message, code=v.code, param="max_tokens" if v.status == 400 else None,
                           headers=headers) from None

    async def _answer_whole(self, request: Request, upstream: EngineStream, ex: Exchange,
                            headers: dict[str, str]) -> Response:
        """A whole answer (or the engine's refusal): read, judged when the cascade asks, recorded."""
        ex.enter("reading")
        try:
            content = await read_or_leave(request, upstream)
        except EngineLinkError:
            return ex.answered(502, _ENGINE_BROKE_OFF, headers)
        finally:
            ex.release()  # the engine is done with it, whatever the judging below still does
        if ex.judge and upstream.status_code == 200:
            return await self.routing.judged(ex, content, headers)
        return ex.answered(upstream.status_code, content, headers)

    async def _answer_stream(self, request: Request, upstream: EngineStream, ex: Exchange, admitted: float,
                             headers: dict[str, str]) -> Response:
        """A stream: its first event read before the client's headers (an error there is a refusal, not a
        200 stream), then spliced through the request's event filter."""
        try:
            first = await race_disconnect(request, anext(upstream, b""), discard=_keep)
        except EngineLinkError:
            await upstream.aclose()
            return ex.answered(502, _ENGINE_BROKE_OFF, headers)
        except BaseException:
            await upstream.aclose()
            raise
        refused = refused_at_start(first)
        if refused is not None:
            await upstream.aclose()
            return ex.answered(refused[0], refused[1], headers)
        ex.rec.status = 200  # the stream has begun; the filter changes it if the stream breaks or the client leaves
        ex.enter("streaming")

        def first_token() -> None:
            if self.admission is not None:
                self.admission.observe_prefill(ex.prompt_tokens, time.perf_counter() - admitted)

        async def on_close() -> None:
            # However the response ends, even when the client left before the splice started.
            await upstream.aclose()
            ex.close()

        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        events = EventFilter(ex, not ex.client_wants_usage, first_token,
                             judge=self.routing.stream_judge(ex) if ex.judge else None)
        return SplicedStream(upstream, first, events, on_close=on_close, headers=headers)

    async def _post(self, path: str, body: bytes, rid: str) -> tuple[EngineStream, str]:
        """The engine's answer, and the digest of the model that gives it. The serving engine's own socket
        and its version are read together, so during an upgrade's switch the label is the engine's that
        answers (the old one finishes what was sent to it). EngineRefused when nothing listens."""
        endpoint = self.supervisor.endpoint()
        socket, version = endpoint if endpoint is not None else (self.settings.engine_socket, self.supervisor.version)
        if socket is None:
            raise self._unreachable(EngineLinkError("no engine socket is configured"))
        try:
            return await EngineStream.open(socket, path, body, self._auth(rid), connect_s=_CONNECT_S,
                                           idle_s=self.settings.upstream_timeout_s), version
        except EngineRefused:
            raise
        except EngineLinkError as e:
            raise self._unreachable(e) from None

    async def _wait_for_restart(self, request: Request, ex: Exchange) -> bool:
        """After the engine's socket refused a request: wait for the supervisor to notice the death (a
        few seconds: the guard's exit and the log's end), then hold the request as during any restart.
        True once the engine serves again; False at once where this request's class holds nothing."""
        if self.settings.class_restart_hold_s.get(ex.cls, self.settings.restart_hold_s) <= 0:
            return False
        if not await self.supervisor.noticed_down(_NOTICE_S):
            return False
        await self._hold_while_restarting(request, ex)
        return self.supervisor.ready

    def _auth(self, rid: str | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.supervisor.internal_key}", "Content-Type": "application/json"}
        if rid:
            h["X-Request-Id"] = rid
        return h

    def _unreachable(self, e: Exception) -> ApiError:
        return retry_later(503, f"the engine did not answer ({type(e).__name__}); retry later", "engine_unreachable",
                           self.settings.retry_after_s)


PREDICTED_TTFT = "X-Appliance-Predicted-TTFT-Ms"
# How long a refused connection waits for the supervisor to see the engine's death (the guard's exit is
# polled every 0.1 s; the end of the engine's log is awaited up to 5 s).
_NOTICE_S = 10.0


def _give_back(gate: AdmissionGate) -> Any:
    async def give_back(ticket: Ticket) -> None:  # a slot granted to a client already gone
        gate.release(ticket)
    return give_back


async def _nothing(_: object) -> None:
    """Nothing to give back for a hold the client left (race_disconnect's discard)."""
