"""The real FastAPI app in-process, with its gateway's engine never started (no vLLM needed): where a test
needs an engine, a scripted one answers on the engine's Unix socket (tests/unit/appliance/api/scripted_engine.py),
so the gateway's own engine leg and splice run as in production."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI

from appliance.api.admission import AdmissionGate
from appliance.api.app import create_app
from appliance.api.gateway import Gateway, GatewaySettings
from appliance.boot import config
from appliance.engine.supervisor import EngineSupervisor
from appliance.ops.metrics import Metrics
from appliance.store import keys
from appliance.store.requests import RequestLog
from cascade.service import Cascade
from tests.unit.appliance.api.scripted_engine import ScriptedEngine


@dataclass
class InProcess:
    cfg: config.Config
    app: FastAPI
    log: RequestLog
    gateway: Gateway


def app(tmp_path: Path, required: bool, ttl: float = 5.0):
    made = gateway(tmp_path, required, ttl)
    return made.cfg, made.app, made.log


def gateway(tmp_path: Path, required: bool, ttl: float = 5.0, engine_socket: Path | None = None,
            admission: AdmissionGate | None = None, cascade: Cascade | None = None) -> InProcess:
    """The app and the gateway behind it; `engine_socket` is where its engine listens."""
    cfg = config.parse(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/state"\n')
    log = RequestLog(cfg.database_path, keep_text=False)
    log.start()
    metrics = Metrics()
    if cascade is not None:
        metrics.attach_cascade(cascade.status)
    gw = Gateway(EngineSupervisor(cfg, []), GatewaySettings("m", 1 << 20, 3, 10.0, engine_socket=engine_socket),
                 log, metrics, admission=admission, cascade=cascade)
    application = create_app(gw, plan=lambda: {"fits": True},
                             verifier=keys.KeyVerifier(cfg.database_path, ttl_s=ttl), keys_required=required)
    return InProcess(cfg, application, log, gw)


def serving(tmp_path: Path, engine: Callable[[httpx.Request], httpx.Response],
            admission: AdmissionGate | None = None, cascade: Cascade | None = None) -> InProcess:
    """The gateway with `engine` answering on its engine socket (a ScriptedEngine, stopped after the test),
    the engine ready."""
    from appliance.engine.args import build_launch
    from appliance.engine.supervisor import EngineState

    scripted = ScriptedEngine.answering(engine)
    made = gateway(tmp_path, required=False, engine_socket=scripted.path, admission=admission, cascade=cascade)
    made.gateway.supervisor.launch = build_launch(made.cfg, [], "k")
    made.gateway.supervisor.status.state = EngineState.READY
    return made


def call(app, method: str, path: str, key: str | None = None, json: dict | None = None, header: str = "bearer"):
    async def go() -> httpx.Response:
        headers = {}
        if key is not None:
            headers = {"Authorization": f"Bearer {key}"} if header == "bearer" else {"X-API-Key": key}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, headers=headers, json=json)

    return asyncio.run(go())
