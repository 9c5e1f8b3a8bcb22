"""The local OpenAI-compatible API (FastAPI), in front of the supervised engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance import __version__
from appliance.api import dialects
from appliance.api.auth import ApiKeyAuth
from appliance.api.errors import ApiError, install_handlers
from appliance.api.faults import FaultBarrier
from appliance.api.gateway import Gateway
from appliance.engine.supervisor import EngineState
from appliance.ops import status_page
from appliance.store.keys import KeyVerifier
from appliance.upgrade.upgrader import Upgrader, UpgradeRefused, UpgradeRequest
from cascade.outbox import STATUSES


def create_app(gateway: Gateway, plan: Callable[[], dict[str, Any]] | None = None,
               verifier: KeyVerifier | None = None, keys_required: bool = False,
               status: Callable[[], dict[str, Any]] | None = None,
               doctor: Callable[[], Awaitable[dict[str, Any]]] | None = None,
               recent_errors: Callable[[], list[dict[str, Any]]] | None = None,
               upgrader: Upgrader | None = None) -> FastAPI:
    """The app: one router per feature, in the order the router tries them (the generation routes first:
    they carry nearly every request), then the key check and the fault barrier around them."""
    app = FastAPI(
        title="Edge LLM appliance",
        version=__version__,
        docs_url=None,  # no interactive docs on a production box; /openapi.json stays
        redoc_url=None,
    )
    install_handlers(app)
    if verifier is not None:
        app.add_middleware(ApiKeyAuth, verifier=verifier, required=keys_required)
    for router in (generation_routes(gateway), health_routes(gateway), operator_routes(gateway, plan, status, doctor),
                   escalation_routes(gateway), page_routes(gateway, plan, status, doctor, recent_errors)):
        app.include_router(router)
    if upgrader is not None:
        app.include_router(upgrade_routes(upgrader))
    # Added last, so outermost: it also catches a fault in the key middleware.
    app.add_middleware(FaultBarrier, on_fault=gateway.metrics.observe_fault if gateway.metrics else None)
    return app


def generation_routes(gateway: Gateway) -> APIRouter:
    """What the engine answers, through the gateway: chat, completions, the Responses API, Anthropic's
    Messages API and the model list (docs/http-api.md's route table)."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.generate(request, dialects.CHAT)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.generate(request, dialects.COMPLETIONS)

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await gateway.generate(request, dialects.RESPONSES)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return await gateway.pass_through(request, f"/v1/responses/{response_id}", with_body=False)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await gateway.pass_through(request, f"/v1/responses/{response_id}/cancel", with_body=False)

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await gateway.generate(request, dialects.MESSAGES)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await gateway.pass_through(request, "/v1/messages/count_tokens")

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await gateway.pass_through(request, "/tokenize")

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await gateway.pass_through(request, "/detokenize")

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await gateway.list_models(request)

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> Response:
        return await gateway.retrieve_model(request, model_id)

    return router


def health_routes(gateway: Gateway) -> APIRouter:
    """Liveness, readiness and the Prometheus scrape: no I/O, answered from memory."""
    router = APIRouter()
    supervisor = gateway.supervisor

    @router.get("/healthz")
    async def healthz() -> dict[str, Any]:
        """The appliance process is alive and its event loop answers."""
        return {"status": "alive", "engine": supervisor.status.state.value}

    @router.get("/readyz")
    async def readyz() -> Response:
        """200 only while the engine serves; 503 with the reason while loading, restarting or failed."""
        st = supervisor.status
        body = {"status": "ready" if st.state is EngineState.READY else "not_ready", "engine": st.as_dict()}
        if st.state is EngineState.READY:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(gateway.settings.retry_after_s)})

    @router.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format: the gateway's figures and the engine's key figures."""
        if gateway.metrics is None:
            raise ApiError(404, "metrics are not enabled in this daemon", code="not_found")
        gateway.metrics.observe_engine(supervisor.status)
        gateway.metrics.held.set(gateway.held)
        if gateway.admission is not None:
            gateway.metrics.observe_admission(gateway.admission.load(), {
                cls: c.ttft_target_s for cls, c in gateway.admission.cfg.classes.items()})
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def operator_routes(gateway: Gateway, plan: Callable[[], dict[str, Any]] | None,
                    status: Callable[[], dict[str, Any]] | None,
                    doctor: Callable[[], Awaitable[dict[str, Any]]] | None) -> APIRouter:
    """/v1/appliance/*: the operator's view of this box (admin scope where keys are required)."""
    router = APIRouter(prefix="/v1/appliance")

    def provided(what: Callable[..., Any] | None, name: str) -> Callable[..., Any]:
        if what is None:
            raise ApiError(404, f"no {name} in this daemon", code="not_found")
        return what

    @router.get("/status")
    async def appliance_status() -> dict[str, Any]:
        """Version, engine state, model digest and pin, plan summary, devices."""
        return provided(status, "status")()

    @router.get("/doctor")
    async def appliance_doctor() -> dict[str, Any]:
        """Setup checks and the troubleshooting recipes applied to the engine's live metrics."""
        return await provided(doctor, "doctor")()

    @router.get("/requests")
    async def appliance_requests() -> dict[str, Any]:
        """The generation requests the gateway holds now, oldest first: phase, age, and for a stream the
        chunks read from the engine and handed to the client (with the seconds since each last moved)."""
        out: dict[str, Any] = {"object": "list", "data": gateway.exchanges.snapshot(),
                               "engine_local_in_flight": gateway.local_in_flight}
        if gateway.admission is not None:
            load = gateway.admission.load()
            out["admission"] = {"in_flight": dict(load.in_flight), "queued": dict(load.queued)}
        return out

    @router.get("/plan")
    async def appliance_plan() -> dict[str, Any]:
        """The KV budget and engine settings the daemon started the engine with."""
        return provided(plan, "plan")()

    return router


class UpgradeBody(BaseModel):
    """POST /v1/appliance/upgrade: what to change (at least one); what is left out stays."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, min_length=1, description="The new model folder, on this box.")
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$",
                               description="The new model's pin (`appliance model pin` prints it).")
    engine_python: str | None = Field(default=None, description="Another engine environment's interpreter.")
    kernels_lock: str | None = Field(default=None, min_length=1, description="That environment's kernel lock.")
    swap: Literal["auto", "beside", "in_place"] | None = Field(default=None, description="upgrade.swap, this once.")


_Body = TypeVar("_Body", bound=BaseModel)


class RollbackBody(BaseModel):
    """POST /v1/appliance/rollback: an empty body, or the swap to make."""

    model_config = ConfigDict(extra="forbid")

    swap: Literal["auto", "beside", "in_place"] | None = None


def _body(model: type[_Body], raw: bytes, code: str) -> _Body:
    """An operator route's JSON body, or 400 naming the first field that is wrong."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        raise ApiError(400, f"{'.'.join(str(x) for x in first['loc']) or 'body'}: {first['msg']}",
                       code=code) from None


def upgrade_routes(upgrader: Upgrader) -> APIRouter:
    """/v1/appliance/upgrade and /rollback (admin scope): start one (202, then follow it with GET), or 409
    with the reason when one cannot start; GET shows the one under way, the versions and the last outcome."""
    router = APIRouter(prefix="/v1/appliance")

    def started(attempt: Any) -> JSONResponse:
        return JSONResponse({"started": attempt.as_dict(), **upgrader.status()}, status_code=202)

    @router.get("/upgrade")
    async def upgrade_status() -> dict[str, Any]:
        return upgrader.status()

    @router.post("/upgrade")
    async def upgrade(request: Request) -> JSONResponse:
        body = _body(UpgradeBody, await request.body(), "invalid_upgrade")
        req = UpgradeRequest(model_path=Path(body.model) if body.model else None, model_digest=body.digest,
                             engine_python=body.engine_python,
                             kernels_lock=Path(body.kernels_lock) if body.kernels_lock else None, swap=body.swap)
        try:
            return started(upgrader.start_upgrade(req))
        except UpgradeRefused as e:
            raise ApiError(409, str(e), code="upgrade_refused") from None

    @router.post("/rollback")
    async def rollback(request: Request) -> JSONResponse:
        body = _body(RollbackBody, await request.body() or b"{}", "invalid_rollback")
        try:
            return started(upgrader.start_rollback(body.swap))
        except UpgradeRefused as e:
            raise ApiError(409, str(e), code="rollback_refused") from None

    return router


def page_routes(gateway: Gateway, plan: Callable[[], dict[str, Any]] | None,
                status: Callable[[], dict[str, Any]] | None,
                doctor: Callable[[], Awaitable[dict[str, Any]]] | None,
                recent_errors: Callable[[], list[dict[str, Any]]] | None) -> APIRouter:
    """GET / and /status: the status page (appliance.ops.status_page), admin scope like /v1/appliance/*."""
    router = APIRouter()

    async def page() -> HTMLResponse:
        if plan is None or status is None or doctor is None:
            raise ApiError(404, "no status page in this daemon", code="not_found")
        load: dict[str, Any] = {"requests": len(gateway.exchanges.snapshot()), "held": gateway.held,
                                "in_flight": {}, "queued": {}, "kv_usage": None}
        if gateway.admission is not None:
            gate = gateway.admission.load()
            load |= {"in_flight": dict(gate.in_flight), "queued": dict(gate.queued), "kv_usage": gate.kv_usage}
        errors = await asyncio.to_thread(recent_errors) if recent_errors is not None else []
        inputs = status_page.PageInputs(status=status(), plan=plan(), doctor=await doctor(), load=load,
                                        recent_errors=errors)
        return HTMLResponse(status_page.render(inputs), headers={"Cache-Control": "no-store"})

    router.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/status", page, methods=["GET"], include_in_schema=False)
    return router


def _owner_filter(request: Request) -> str | None:
    """None: may see all. A key that is not an admin key sees its own escalations only."""
    key = request.scope.get("state", {}).get("api_key")
    if key is None or key.admin:
        return None
    return key.id


def escalation_routes(gateway: Gateway) -> APIRouter:
    """/v1/escalations: what was sent to the regional cluster, and its answers (read in a worker thread)."""
    router = APIRouter(prefix="/v1/escalations")

    @router.get("")
    async def list_escalations(request: Request, status: str | None = None, limit: str = "50") -> dict[str, Any]:
        """Escalations, newest first: every one for an admin key (or on loopback without keys), else the
        caller's own. Summaries only; the answer is at /v1/escalations/{id}."""
        if status is not None and status not in STATUSES:
            raise ApiError(400, f"status must be one of {', '.join(STATUSES)} (got {status!r})",
                           code="invalid_parameter", param="status")
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            raise ApiError(400, f"limit must be a whole number from 1 to 1000 (got {limit!r})",
                           code="invalid_parameter", param="limit")
        if gateway.cascade is None:
            return {"object": "list", "data": []}
        owner = _owner_filter(request)
        rows = await asyncio.to_thread(gateway.cascade.outbox.list, status, owner, int(limit))
        return {"object": "list", "data": [e.summary() for e in rows]}

    @router.get("/{esc_id}")
    async def get_escalation(request: Request, esc_id: str) -> dict[str, Any]:
        """One escalation with the regional answer once it has arrived."""
        esc = await asyncio.to_thread(gateway.cascade.outbox.get, esc_id) if gateway.cascade is not None else None
        owner = _owner_filter(request)
        if esc is None or (owner is not None and esc.key_id != owner):
            raise ApiError(404, f"no escalation with id {esc_id!r}", code="escalation_not_found", param="id")
        label = await asyncio.to_thread(gateway.cascade.outbox.label, esc_id) if gateway.cascade is not None else None
        return {**esc.summary(), "answer": esc.answer, "agreement": label}

    return router
