"""The running daemon: start and stop order, signals, and what it tells systemd.

    config -> plan -> engine supervisor -> API (uvicorn) -> serve until a signal
                                                        or until the supervisor gives up

Its parts are built by appliance.boot.assembly and handed over finished. Start: the API listens first, so
/healthz and /readyz (503 "loading") answer while the engine loads. Stop (SIGTERM/SIGINT): the API
stops accepting, the engine is stopped (SIGTERM, then SIGKILL after the grace period), the request
log is flushed. Exit status: 0 after a clean stop, 1 when the engine failed too often (so systemd's
Restart= and the operator see it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import signal
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from appliance.api.admission import AdmissionGate
from appliance.api.gateway import Gateway
from appliance.api.http_protocol import GuardedHttpProtocol
from appliance.boot.config import Config, ConfigError, ServerSection
from appliance.boot.config import load as load_config
from appliance.boot.net import http_url
from appliance.boot.site_state import SiteState
from appliance.engine.supervisor import EngineState, EngineStatus, EngineSupervisor
from appliance.engine.watch import EngineWatch
from appliance.ops import state_dump
from appliance.ops.metrics import Metrics
from appliance.ops.remedies import Remedies
from appliance.runtime.loop_monitor import LoopMonitor
from appliance.runtime.systemd import Notifier
from appliance.store.keys import KeyVerifier
from appliance.store.requests import RequestLog
from appliance.upgrade.versions import VersionsError, effective_config
from cascade.service import Cascade

log = logging.getLogger("appliance")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_OK = 0
EXIT_ENGINE_FAILED = 1


class _ApiServer(uvicorn.Server):
    """uvicorn's server without its own signal handling.

    uvicorn re-raises a captured SIGTERM after it stops serving, which would kill
    the daemon before it has stopped the engine and flushed its state; the daemon
    owns the signals and tells the server when to exit.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class Daemon:
    """Every part, finished (see appliance.boot.assembly.build); run() serves until stopped."""

    state: SiteState
    request_log: RequestLog
    metrics: Metrics
    supervisor: EngineSupervisor
    admission: AdmissionGate | None
    cascade: Cascade | None
    gateway: Gateway
    engine_watch: EngineWatch
    remedies: Remedies
    verifier: KeyVerifier
    keys_required: bool
    app: FastAPI
    notifier: Notifier
    loop_monitor: LoopMonitor

    def __post_init__(self) -> None:
        self._server: uvicorn.Server | None = None
        self._ready_sent = False

    @property
    def cfg(self) -> Config:
        return self.state.cfg

    @property
    def api_url(self) -> str:
        return http_url(self.cfg.server.host, self.cfg.server.port, "/v1")

    async def run(self) -> int:
        self._log_plan()
        _raise_fd_limit(self.cfg.server.max_connections)
        self.cfg.state.directory.mkdir(parents=True, exist_ok=True)
        self.request_log.start()
        server = _ApiServer(server_config(self.app, self.cfg.server))
        self._server = server
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_stop_signal, server, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        loop.add_signal_handler(signal.SIGUSR1, self._dump_state)
        self.supervisor.add_listener(self._on_engine_state)
        self.notifier.status("starting: loading model")
        await self.supervisor.start()
        background = [asyncio.create_task(self._extend_start_timeout()), asyncio.create_task(self._watchdog()),
                      asyncio.create_task(self.engine_watch.run()),
                      asyncio.create_task(self.loop_monitor.run(), name="loop-monitor"),
                      asyncio.create_task(self.remedies.run(), name="doctor")]
        if self.cascade is not None and self.cascade.forwarder is not None:
            background.append(asyncio.create_task(self.cascade.forwarder.run(), name="forwarder"))
        if self.cascade is not None and self.cascade.calibrator is not None:
            background.append(asyncio.create_task(self.cascade.run_calibration(), name="calibrator"))
        if self.cascade is not None and self.cascade.webhooks is not None:
            background.append(asyncio.create_task(self.cascade.webhooks.run(), name="webhooks"))
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
            for task in background:
                task.cancel()
            self.notifier.stopping()
            log.info("stopping the engine")
            await self.supervisor.stop()
            await self.gateway.aclose()
            if self.cascade is not None:
                await self.cascade.aclose()
            self.request_log.close()
            log.info("stopped")

    def _log_plan(self) -> None:
        p = self.state.site_plan.plan
        discovery = self.state.site_plan.discovery
        where = discovery.error or ", ".join(g.name for g in discovery.gpus)
        log.info("devices: %s", where)
        if p.capacity:
            log.info("plan: KV pool %d bytes, %d blocks of %d tokens, %s tokens, max concurrency %.2f at %d tokens "
                     "(figures from %s)", p.memory.kv_pool, p.capacity.num_blocks,
                     p.vllm.block_size if p.vllm else p.layout.block_size if p.layout else 0,
                     f"{p.capacity.tokens_reported:,}", p.capacity.max_concurrency, p.engine.max_model_len, p.source)
        for d in p.disagreements:
            log.warning("plan: the kvbudget model disagrees with vLLM, which the plan follows: %s", d)
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
            asyncio.get_running_loop().create_task(self._announce_ready())
            return
        log.info("engine %s: %s", st.state.value, st.reason)
        status = {
            EngineState.STARTING: f"starting: {st.reason}",
            EngineState.RESTARTING: f"degraded: engine restarting ({st.reason})",
            EngineState.FAILED: f"failed: {st.reason}",
        }.get(st.state)
        if status:
            self.notifier.status(status)

    async def _announce_ready(self) -> None:
        """READY=1 once: the engine answers and the API listens. After a restart, STATUS only."""
        while self._server is not None and not self._server.started:
            await asyncio.sleep(0.05)
        status = f"serving: {self.cfg.served_name} at {self.api_url}"
        if self._ready_sent:
            self.notifier.status(status)
        else:
            self._ready_sent = True
            self.notifier.ready(status)

    async def _extend_start_timeout(self) -> None:
        """Keep TimeoutStartSec from firing while a first start (load, compile, warm-up) makes progress."""
        while not self._ready_sent and self.supervisor.status.state is EngineState.STARTING:
            self.notifier.extend_timeout()
            await asyncio.sleep(20)

    async def _watchdog(self) -> None:
        """WATCHDOG=1 from the event loop itself: a wedged loop stops pinging and systemd restarts us.

        An engine restart is the supervisor doing its job, so pings continue through it; a supervisor
        that gave up makes the daemon exit non-zero instead.
        """
        interval = self.notifier.watchdog_interval_s
        if not interval:
            return
        while not self.supervisor.gave_up.is_set():
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _dump_state(self) -> None:
        """SIGUSR1: what the daemon is doing now, to the log (appliance.ops.state_dump)."""
        log.warning("%s", state_dump.render(self.gateway.exchanges.snapshot()))

    def _reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what can change live, name what needs a restart."""
        self.notifier.reloading()
        try:
            new, _ = effective_config(load_config(self.cfg.source))
        except (ConfigError, VersionsError) as e:
            log.error("reload refused, keeping the running configuration: %s", e)
        else:
            old_d, new_d = self.cfg.model_dump(), new.model_dump()
            self.request_log.keep_text = new.state.log_prompts
            self.verifier.invalidate()  # revocations take effect now
            live = {"state", "doctor"}
            needs_restart = sorted(k for k in new_d if new_d[k] != old_d[k] and k not in live)
            if needs_restart:
                log.warning("reload: changes to %s take effect at the next restart", ", ".join(needs_restart))
            self.state.cfg = self.cfg.model_copy(update={"state": new.state, "doctor": new.doctor})
            log.info("configuration reloaded from %s", self.cfg.source)
        status = f"serving: {self.cfg.served_name} at {self.api_url}" if self.supervisor.ready else "starting"
        if self._ready_sent:
            self.notifier.ready(status)
        else:
            self.notifier.status(status)



def serve(ready) -> int:
    """Build the daemon from checked start-up results (appliance.boot.startup.prepare) and run it."""
    from appliance.boot.assembly import build

    daemon = build(ready.cfg, ready.site_plan, ready.model_check, ready.kernel_check, file_cfg=ready.file_cfg,
                   recovered=ready.recovered)
    settle_memory()
    try:
        import uvloop
    except ImportError:  # uvloop is optional; asyncio's own loop works, a little slower
        return asyncio.run(daemon.run())
    return uvloop.run(daemon.run())


# A young-generation collection after this many new container objects, not CPython's 700: a streamed request
# makes several hundred short-lived ones (its JSON, pydantic's model, headers, events), so the default ran a
# collection about every request, and each older-generation pass walked every object start-up made.
GC_YOUNG_THRESHOLD = 20_000


def settle_memory() -> None:
    """Once the daemon is built, before it serves: what start-up made (modules, the app, the plan; tens of
    thousands of objects) lives as long as the daemon, so it is frozen out of the collector's passes, and
    the young generation may grow to GC_YOUNG_THRESHOLD objects before one. Garbage is still collected,
    cycles included, only less often. Measured with bench/gateway_overhead.py (bench/RESULTS.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)


# Beyond the client connections: the engine's, the database's, logs, the engine's pipes.
_FD_HEADROOM = 256


def _raise_fd_limit(max_connections: int) -> None:
    """Lift the soft open-files limit to the hard one (systemd's default soft limit is 1024), so the
    connection cap, not the limit, is what refuses a client; say so when even the hard limit is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, max_connections + _FD_HEADROOM)
    if want > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    if soft < max_connections + _FD_HEADROOM:
        log.warning("open-files limit %d is short of server.max_connections %d plus %d: raise LimitNOFILE in "
                    "the unit or lower max_connections", soft, max_connections, _FD_HEADROOM)


def server_config(app: Any, server: ServerSection) -> uvicorn.Config:
    """How the daemon serves its API: uvicorn with the guarded connection layer (benchmarks serve the app
    the same way)."""
    return uvicorn.Config(
        app, host=server.host, port=server.port, log_config=None, access_log=False, lifespan="off",
        timeout_graceful_shutdown=10,
        http=GuardedHttpProtocol.configured(
            header_timeout_s=server.header_timeout_s, body_timeout_s=server.body_timeout_s,
            max_connections=server.max_connections, retry_after_s=server.retry_after_s))
