"""The composition root: builds every part from the configuration and owns start and stop order.

    config -> request log -> engine supervisor -> API (uvicorn) -> serve until a signal
                                                             or until the supervisor gives up

Start: the API listens first, so /healthz and /readyz (503 "loading") answer
while the engine loads. Stop (SIGTERM/SIGINT): the API stops accepting, the
engine is stopped (SIGTERM, then SIGKILL after the grace period), the request
log is flushed. Exit status: 0 after a clean stop, 1 when the engine failed too
often (so systemd's Restart= and the operator see it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from appliance.api.app import create_app
from appliance.api.auth import keys_required
from appliance.api.proxy import EngineProxy, GatewaySettings
from appliance.config import Config
from appliance.planning import SitePlan
from appliance.engine.supervisor import EngineState, EngineStatus, EngineSupervisor
from appliance.keys import KeyVerifier
from appliance.metrics import Metrics
from appliance.store import RequestLog
from kvbudget.render import plan_dict

log = logging.getLogger("appliance")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _ApiServer(uvicorn.Server):
    """uvicorn's server without its own signal handling.

    uvicorn re-raises a captured SIGTERM after it stops serving, which would kill
    the daemon before it has stopped the engine and flushed its state; the daemon
    owns the signals and tells the server when to exit.
    """

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield

EXIT_OK = 0
EXIT_ENGINE_FAILED = 1


class Daemon:
    def __init__(self, cfg: Config, site_plan: SitePlan) -> None:
        self.cfg = cfg
        self.site_plan = site_plan
        self.request_log = RequestLog(cfg.database_path, keep_text=cfg.state.log_prompts)
        self.supervisor = EngineSupervisor(cfg, site_plan.plan.vllm_args)
        self.proxy = EngineProxy(
            self.supervisor,
            GatewaySettings(
                served_name=cfg.served_name,
                max_body_bytes=int(cfg.server.max_body_bytes),
                retry_after_s=cfg.server.retry_after_s,
                upstream_timeout_s=cfg.server.upstream_timeout_s,
            ),
            self.request_log,
            Metrics(),
        )
        self.keys_required = keys_required(cfg.auth.require_keys, cfg.server.host)
        self.app = create_app(self.proxy, plan=lambda: plan_dict(self.site_plan.plan),
                              verifier=KeyVerifier(cfg.database_path), keys_required=self.keys_required)

    @property
    def api_url(self) -> str:
        host = self.cfg.server.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.cfg.server.port}/v1"

    async def run(self) -> int:
        self._log_plan()
        self.cfg.state.directory.mkdir(parents=True, exist_ok=True)
        self.request_log.start()
        server = _ApiServer(
            uvicorn.Config(
                self.app,
                host=self.cfg.server.host,
                port=self.cfg.server.port,
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=10,
            )
        )
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_stop_signal, server, sig)
        self.supervisor.add_listener(self._on_engine_state)
        await self.supervisor.start()
        log.info("API listening on %s (engine loading; /readyz says 503 until it is ready); API keys %s",
                 self.api_url, "required" if self.keys_required else "not required (loopback)")
        serving = asyncio.create_task(server.serve(), name="api")
        gave_up = asyncio.create_task(self.supervisor.gave_up.wait())
        try:
            done, _ = await asyncio.wait({serving, gave_up}, return_when=asyncio.FIRST_COMPLETED)
            if gave_up in done:
                log.error("stopping: %s", self.supervisor.status.reason)
                server.should_exit = True
                await serving
                return EXIT_ENGINE_FAILED
            if serving.exception() is not None or not server.started:
                log.error("the API could not listen on %s:%d", self.cfg.server.host, self.cfg.server.port)
                return EXIT_ENGINE_FAILED
            return EXIT_OK
        finally:
            gave_up.cancel()
            log.info("stopping the engine")
            await self.supervisor.stop()
            await self.proxy.aclose()
            self.request_log.close()
            log.info("stopped")

    def _log_plan(self) -> None:
        p = self.site_plan.plan
        where = self.site_plan.discovery.error or ", ".join(g.name for g in self.site_plan.discovery.gpus)
        log.info("devices: %s", where)
        if p.capacity:
            log.info("plan: KV pool %d bytes, %d blocks of %d tokens, %s tokens, max concurrency %.2f at %d tokens",
                     p.memory.kv_pool, p.capacity.num_blocks, p.layout.block_size if p.layout else 0,
                     f"{p.capacity.tokens_reported:,}", p.capacity.max_concurrency, p.engine.max_model_len)
        for f in p.findings:
            log.warning("plan: target %s not met: wanted %s, got %s; options: %s", f.target, f.wanted, f.achieved,
                        "; ".join(f.remedies))
        log.info("plan: engine arguments %s", " ".join(p.vllm_args))

    def _on_stop_signal(self, server: uvicorn.Server, sig: signal.Signals) -> None:
        log.info("received %s: stopping", sig.name)
        server.should_exit = True

    def _on_engine_state(self, st: EngineStatus) -> None:
        if st.state is EngineState.READY:
            log.info("ready: model '%s' served at %s", self.cfg.served_name, self.api_url)
        else:
            log.info("engine %s: %s", st.state.value, st.reason)


def serve(cfg: Config, site_plan: SitePlan) -> int:
    daemon = Daemon(cfg, site_plan)
    try:
        import uvloop
    except ImportError:  # uvloop is optional; asyncio's own loop works, a little slower
        return asyncio.run(daemon.run())
    return uvloop.run(daemon.run())
