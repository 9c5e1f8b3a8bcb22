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
from dataclasses import replace
import logging
import signal

import uvicorn

from appliance import __version__, doctor, state_dump
from appliance.admission import AdmissionConfig, AdmissionGate
from appliance.api.app import create_app
from appliance.api.auth import keys_required
from appliance.api.proxy import EngineProxy, GatewaySettings
from appliance.config import Config, ConfigError
from appliance.config import load as load_config
from appliance.planning import SitePlan
from appliance.engine.supervisor import EngineState, EngineStatus, EngineSupervisor
from appliance.engine_watch import EngineWatch
from appliance.loop_monitor import LoopMonitor
from appliance.escalation import build_cascade
from appliance.keys import KeyVerifier
from appliance.metrics import Metrics
from appliance.model_pin import ModelCheck
from appliance.store import RequestLog
from appliance.systemd import Notifier
from kernels.lock import KernelCheck
from kvbudget.planner import Plan
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
    def __init__(self, cfg: Config, site_plan: SitePlan, model_check: ModelCheck | None = None,
                 kernel_check: KernelCheck | None = None) -> None:
        self.cfg = cfg
        self.site_plan = site_plan
        self.model_check = model_check
        self.kernel_check = kernel_check
        self.request_log = RequestLog(cfg.database_path, keep_text=cfg.state.log_prompts)
        self.metrics = Metrics()
        if model_check is not None:
            self.metrics.model_info.labels(cfg.served_name, model_check.digest, str(model_check.ok).lower()).set(1)
        if kernel_check is not None:
            self.metrics.kernels_info.labels(kernel_check.digest or "", str(kernel_check.ok).lower()).set(1)
        self.supervisor = EngineSupervisor(cfg, site_plan.plan.vllm_args)
        self.admission = self._admission_gate(cfg, site_plan)
        self.cascade = build_cascade(cfg, site_plan.plan.engine.max_model_len, self.metrics)
        self.proxy = EngineProxy(
            self.supervisor,
            GatewaySettings(
                served_name=cfg.served_name,
                max_body_bytes=int(cfg.server.max_body_bytes),
                retry_after_s=cfg.server.retry_after_s,
                upstream_timeout_s=cfg.server.upstream_timeout_s,
                default_class=cfg.admission.anonymous_class,
            ),
            self.request_log,
            self.metrics,
            self.admission,
            self.cascade,
        )
        # Polled only while the engine serves: a loading engine refusing connections is no scrape error.
        self.engine_watch = EngineWatch(self.proxy.client,
                                        lambda: self.supervisor.base_url if self.supervisor.ready else None,
                                        on_error=self.metrics.engine_scrape_errors.inc)
        self.metrics.attach_engine(lambda: self.engine_watch.latest_text)
        if self.admission is not None:
            self.engine_watch.add_listener(lambda s: self.admission.observe_kv_usage(s.kv_usage))
        self.keys_required = keys_required(cfg.auth.require_keys, cfg.server.host)
        self.verifier = KeyVerifier(cfg.database_path)
        self.app = create_app(self.proxy, plan=lambda: plan_dict(self.site_plan.plan),
                              verifier=self.verifier, keys_required=self.keys_required, status=self.status,
                              doctor=self.doctor)
        self.notifier = Notifier()
        self.loop_monitor = LoopMonitor(on_stall=self.metrics.loop_stalls.observe)
        self._server: uvicorn.Server | None = None
        self._ready_sent = False
        self._speculation_off: str | None = None  # why the daemon turned speculative decoding off, if it did

    def _admission_gate(self, cfg: Config, site_plan: SitePlan) -> AdmissionGate | None:
        if not cfg.admission.enabled:
            return None
        gate = AdmissionGate(AdmissionConfig.from_section(cfg.admission, site_plan.plan.max_num_seqs))
        gate.on_decision = self.metrics.observe_decision
        return gate

    def status(self) -> dict:
        """GET /v1/appliance/status: what a fleet operator compares across sites."""
        mc = self.model_check
        p = self.site_plan.plan
        return {
            "site": self.cfg.site.name,
            "version": __version__,
            "engine": self.supervisor.status.as_dict(),
            "model": {
                "served_name": self.cfg.served_name,
                "path": str(self.cfg.model.path),
                "digest": mc.digest if mc else None,
                "pinned": mc.pinned if mc else None,
                "matches_pin": mc.ok if mc and mc.pinned else None,
            },
            "plan": {"kv_pool_bytes": p.memory.kv_pool, "max_model_len": p.engine.max_model_len,
                     "max_num_seqs": p.max_num_seqs,
                     "speculative": {"method": p.speculative.method,
                                     "reason": self._speculation_off or p.speculative.reason},
                     "kv_tokens": p.capacity.tokens_reported if p.capacity else None,
                     "targets_met": p.targets_met},
            "devices": self.site_plan.discovery.as_dict(),
            "kernels": {"lock": kc.lock_path, "digest": kc.digest, "matches_lock": kc.ok,
                        "mismatches": [str(m).strip() for m in kc.mismatches[:50]], "error": kc.error}
            if (kc := self.kernel_check) is not None else {"lock": None},
            "cascade": self.cascade.status() if self.cascade is not None else {"configured": False},
        }

    async def doctor(self) -> dict:
        """GET /v1/appliance/doctor: the setup checks (the model hashed at start, not again) and the
        recipes over the last half hour of engine samples."""
        setup = await asyncio.to_thread(doctor.setup_checks, self.cfg, self.site_plan.discovery, self.model_check,
                                        self.kernel_check)
        st = self.supervisor.status
        p = self.site_plan.plan
        live = [doctor.engine_state(st.state.value, st.reason, st.restarts),
                *doctor.recipes(self.engine_watch.since(doctor.LIVE_WINDOW_S), capacity=p.max_num_seqs,
                                spec_method=p.speculative.method, workload=self.cfg.targets.workload)]
        return doctor.as_dict([*setup, *live])

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
                      asyncio.create_task(self._act_on_recipes(), name="doctor")]
        if self.cascade is not None and self.cascade.forwarder is not None:
            background.append(asyncio.create_task(self.cascade.forwarder.run(), name="forwarder"))
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
            await self.proxy.aclose()
            if self.cascade is not None:
                await self.cascade.aclose()
            self.request_log.close()
            log.info("stopped")

    def _log_plan(self) -> None:
        p = self.site_plan.plan
        where = self.site_plan.discovery.error or ", ".join(g.name for g in self.site_plan.discovery.gpus)
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

    async def _act_on_recipes(self) -> None:
        # Runs whatever [doctor] says now: a reload (SIGHUP) may switch acting on or off, or change the interval.
        while True:
            await asyncio.sleep(self.cfg.doctor.check_interval_s)
            try:
                await self.act_on_recipes()
            except Exception:  # a bug here must not take the serving daemon down
                log.exception("acting on the doctor's findings failed")

    async def act_on_recipes(self) -> str | None:
        """[doctor] disable_decayed_speculation: section 8's remedy, applied by the box itself.

        Returns what was done, or None. The change lasts until the service restarts; the log line
        tells the operator how to make it permanent.
        """
        p = self.site_plan.plan
        if not self.cfg.doctor.disable_decayed_speculation or p.speculative.method == "none" \
                or not self.supervisor.ready:
            return None
        finding = doctor.spec_acceptance(self.engine_watch.since(doctor.LIVE_WINDOW_S), p.speculative.method)
        if finding.status != "warn":
            return None
        off = self.site_plan.without_speculation  # planned at start: the probe would crawl on a busy box
        if not isinstance(off, Plan):
            log.error("speculative decoding should go off (%s) but the engine cannot be planned without it: %s",
                      finding.summary, off)
            return None
        site_plan = replace(self.site_plan, plan=off, without_speculation=None)
        action = f"speculative decoding ({p.speculative.method}) turned off: {finding.summary}"
        log.warning("doctor: %s; relaunching the engine without it. Until the service restarts: set "
                    "targets.speculative = \"off\" to keep it off", action)
        self.site_plan = site_plan  # self.cfg stays as the file says, so a reload compares like with like
        if self.admission is not None:  # the plan without drafts may hold a different number of sequences
            self.admission.cfg = AdmissionConfig.from_section(self.cfg.admission, site_plan.plan.max_num_seqs)
        self._speculation_off = action
        self.metrics.doctor_actions.labels("speculative_off").inc()
        # The old engine's samples say nothing about the new one; poll_once would only notice the reset at
        # the new engine's first sample, and until then the doctor would judge a dead engine's numbers.
        self.engine_watch.clear()
        await self.supervisor.relaunch(site_plan.plan.vllm_args, action, drain=self._drain_local_requests)
        return action

    async def _drain_local_requests(self) -> None:
        """Let the answers the engine is giving finish before it goes: a planned relaunch cuts nobody off."""
        limit = self.cfg.doctor.relaunch_drain_s
        busy = self.proxy.local_in_flight
        if busy:
            log.info("waiting up to %gs for %d request(s) in flight to finish before the relaunch", limit, busy)
        left = await self.proxy.drained(limit)
        if left:
            log.warning("%d request(s) still running after %gs are cut off by the relaunch", left, limit)

    def _dump_state(self) -> None:
        """SIGUSR1: what the daemon is doing now, to the log (appliance.state_dump)."""
        log.warning("%s", state_dump.render(self.proxy.inflight.snapshot()))

    def _reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what can change live, name what needs a restart."""
        self.notifier.reloading()
        try:
            new = load_config(self.cfg.source)
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
        else:
            old_d, new_d = self.cfg.model_dump(), new.model_dump()
            self.request_log.keep_text = new.state.log_prompts
            self.verifier.clear()  # revocations take effect now
            live = {"state", "doctor"}
            needs_restart = sorted(k for k in new_d if new_d[k] != old_d[k] and k not in live)
            if needs_restart:
                log.warning("reload: changes to %s take effect at the next restart", ", ".join(needs_restart))
            self.cfg = self.cfg.model_copy(update={"state": new.state, "doctor": new.doctor})
            log.info("configuration reloaded from %s", self.cfg.source)
        status = f"serving: {self.cfg.served_name} at {self.api_url}" if self.supervisor.ready else "starting"
        if self._ready_sent:
            self.notifier.ready(status)
        else:
            self.notifier.status(status)


def serve(cfg: Config, site_plan: SitePlan, model_check: ModelCheck | None = None,
          kernel_check: KernelCheck | None = None) -> int:
    daemon = Daemon(cfg, site_plan, model_check, kernel_check)
    try:
        import uvloop
    except ImportError:  # uvloop is optional; asyncio's own loop works, a little slower
        return asyncio.run(daemon.run())
    return uvloop.run(daemon.run())
