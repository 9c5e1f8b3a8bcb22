"""The one owner of an upgrade (or a rollback) on a running box: stage, swap, gate, probation, commit.

    stage      the new model folder hashed against its pin, the new engine environment against its kernel
               lock, both planned with vLLM's probe; anything off refuses before the running engine is touched
    swap       new requests are held (server.restart_hold_s), the answers in flight finish (upgrade.drain_s),
               the old engine stops and the new one starts (one engine at a time: see docs/operations.md)
    gate       the new engine, healthy, answers the golden set before it takes traffic (appliance.upgrade.golden)
    probation  it serves for upgrade.probation_s; a death or too many 5xx answers roll it back
    commit     the versions file names it; the version before it is kept for `appliance rollback`

Any failure after stage brings the previous engine back at once (EngineSupervisor's Trial) and leaves the
committed version as it was. Each step is written to the journal first, so a daemon killed at any point
restarts on the committed version and says which step the upgrade died in (VersionStore.recover).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from appliance.api.admission import AdmissionGate
from appliance.api.gateway import Gateway
from appliance.boot import model_pin
from appliance.boot.model_pin import ModelCheck
from appliance.boot.planning import PlanningError, SitePlan, plan_for_config
from appliance.boot.site_state import SiteState
from appliance.boot.startup import engine_problems, model_problems
from appliance.engine.args import engine_settings
from appliance.engine.supervisor import EngineSupervisor, Gate, Trial
from appliance.engine.watch import EngineWatch
from appliance.ops.metrics import Metrics
from appliance.upgrade import golden, swap
from appliance.upgrade.swap import SwapMode
from appliance.upgrade.versions import Journal, Outcome, Version, VersionStore
from kvbudget.gpu import discover
from quantize.build import read_description

log = logging.getLogger("appliance.upgrade")


class UpgradeRefused(Exception):
    """The upgrade cannot start or did not pass staging; the running engine was not touched."""


@dataclass(frozen=True)
class UpgradeRequest:
    """What to change; what is left out stays as it runs now."""

    model_path: Path | None = None
    model_digest: str | None = None  # required with model_path unless the folder holds its pin manifest
    engine_python: str | None = None
    kernels_lock: Path | None = None
    swap: SwapMode | None = None  # None: upgrade.swap


@dataclass(frozen=True)
class Staged:
    """A version checked and planned, ready to launch."""

    version: Version
    cfg: Any  # Config
    site_plan: SitePlan
    args: list[str]
    model_check: ModelCheck


@dataclass
class Attempt:
    """The upgrade under way, as `appliance upgrade --status` and /v1/appliance/upgrade show it."""

    id: str
    kind: str
    target: Version
    source: Version
    swap: SwapMode = "auto"  # as asked; `mode` is what stage chose
    started: float = field(default_factory=time.time)
    step: str = "stage"
    mode: str | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "step": self.step, "target": self.target.describe(),
                "from": self.source.describe(), "swap": self.mode, "started": self.started, "steps": self.steps}


class Upgrader:
    def __init__(self, state: SiteState, file_version: Version, supervisor: EngineSupervisor, gateway: Gateway,
                 admission: AdmissionGate | None, watch: EngineWatch, metrics: Metrics) -> None:
        self.state = state
        self.file_version = file_version  # the configuration file's own version (VersionStore's `base`)
        self.supervisor = supervisor
        self.gateway = gateway
        self.admission = admission
        self.watch = watch
        self.metrics = metrics
        self.store = VersionStore(state.cfg.state.directory)
        self.attempt: Attempt | None = None
        self._task: asyncio.Task[None] | None = None
        self._started_on = self.running_version()  # what is committed while the box has no history of its own
        self.show_versions()

    # -- what the routes call ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        h = self.store.current(self.file_version)
        return {
            "running": self.attempt.as_dict() if self.attempt else None,
            "committed": (h.committed if h else self._started_on).describe(),
            "previous": h.previous.describe() if h and h.previous else None,
            "last": vars(h.last) if h and h.last else None,
        }

    def start_upgrade(self, req: UpgradeRequest) -> Attempt:
        if req.model_path is None and req.engine_python is None and req.kernels_lock is None:
            raise UpgradeRefused("nothing to change: give a model folder, an engine interpreter or both")
        running = self.running_version()
        target = Version(
            model_path=str(req.model_path) if req.model_path else running.model_path,
            model_digest=req.model_digest or ("" if req.model_path else running.model_digest),
            served_name=running.served_name,
            engine_python=req.engine_python if req.engine_python is not None else running.engine_python,
            kernels_lock=str(req.kernels_lock) if req.kernels_lock else running.kernels_lock)
        return self._start("upgrade", target, req.swap)

    def start_rollback(self, swap: SwapMode | None = None) -> Attempt:
        h = self.store.current(self.file_version)
        if h is None or h.previous is None:
            raise UpgradeRefused("no previous version to roll back to: this box has not been upgraded since its "
                                 "configuration file last changed")
        return self._start("rollback", replace(h.previous, served_name=self.state.cfg.served_name), swap)

    def _start(self, kind: str, target: Version, swap: SwapMode | None) -> Attempt:
        if self.attempt is not None:
            raise UpgradeRefused(f"an {self.attempt.kind} is under way ({self.attempt.step}); wait for it to end")
        if not self.supervisor.ready:
            raise UpgradeRefused(f"the engine is not serving ({self.supervisor.status.reason}); an upgrade starts "
                                 "from a serving engine")
        source = self.running_version()
        if target.same_as(source):
            raise UpgradeRefused(f"the box already runs {target.describe()}")
        self.attempt = Attempt(secrets.token_hex(4), kind, target, source, swap or self.state.cfg.upgrade.swap)
        self._task = asyncio.create_task(self._run(self.attempt), name=kind)
        return self.attempt

    # -- the steps --------------------------------------------------------------------------------------

    async def _run(self, a: Attempt) -> None:
        try:
            await self._steps(a)
        except Exception as e:  # a bug here must not leave the box half-swapped nor the attempt stuck
            log.exception("%s %s failed", a.kind, a.id)
            if self.supervisor.on_trial:
                await self.supervisor.abandon_trial(f"the upgrade itself failed: {e}", self._drain)
            self._finish(a, "rolled_back", f"the upgrade itself failed: {e}")
        finally:
            self.attempt = None

    async def _steps(self, a: Attempt) -> None:
        self._step(a, "stage", f"checking {a.target.describe()}")
        try:
            staged = await self._stage(a.target)
            cases = golden.load(self.state.cfg.upgrade.golden_set)
            # The running model's answers, for the agreement check; not for a rollback (the model being left
            # is the one in doubt).
            reference = await self._ask_running(cases) if a.kind == "upgrade" else None
        except (UpgradeRefused, golden.GoldenSetError) as e:
            self._finish(a, "refused", str(e))
            return
        before = (self.state.cfg, self.state.site_plan, self.state.model_check, self.state.model_build)
        trial = await self._swap(a, staged, lambda socket: self._gate(a, socket, cases, reference))
        failed = await self._until_serving(trial)
        if failed is not None:
            await self._rolled_back(a, failed)
            return
        self._adopt(staged)
        if a.mode == "beside":
            # New requests go to the new engine already; the old one answers what was sent to it, then stops.
            sent_to_old = self.gateway.exchanges.answering_now()
            await self.supervisor.retire_previous(lambda: self._drain(sent_to_old))
        self._step(a, "probation", f"serving; watched for {self.state.cfg.upgrade.probation_s:g}s")
        failed = await self._probation(trial)
        if failed is not None:
            if not trial.failed.done():
                await self.supervisor.abandon_trial(failed, self._drain)
            self._restore(*before)
            await self._rolled_back(a, failed)
            return
        self.supervisor.end_trial()
        self._step(a, "commit", f"committing {a.target.describe()}")
        outcome = Outcome(a.id, a.kind, "committed", "commit", "passed its gate and probation", a.target.describe())
        self.store.commit(self.file_version, replace(staged.version, note=a.kind), a.source, outcome)
        self._counted(a, outcome)
        self.show_versions()

    async def _swap(self, a: Attempt, staged: Staged, gate: Gate) -> Trial:
        a.mode, why = await asyncio.to_thread(swap.choose, a.swap, staged.site_plan.plan, discover)  # NVML
        reason = f"{a.kind} to {a.target.describe()}"
        if a.mode == "beside":
            self._step(a, "swap", f"starting the new engine beside the running one, which serves meanwhile ({why})")
            return await self.supervisor.try_beside(staged.cfg, staged.args, staged.model_check.digest, reason, gate,
                                                    yield_cpu=staged.site_plan.plan.platform.kind == "cpu")
        self._step(a, "swap", f"holding new requests, letting the answers in flight finish, starting the new "
                              f"engine in place of the old ({why})")
        return await self.supervisor.try_launch(staged.cfg, staged.args, staged.model_check.digest, reason,
                                                self._drain, gate)

    async def _stage(self, target: Version) -> Staged:
        cfg = target.apply(self.state.cfg)
        problems = [*model_problems(cfg), *engine_problems(cfg)]
        if problems:
            raise UpgradeRefused("; ".join(problems))
        try:
            check = await asyncio.to_thread(model_pin.check, cfg.model.path, cfg.model.digest or None)
        except OSError as e:
            raise UpgradeRefused(f"cannot read the model folder {cfg.model.path}: {e}") from None
        if check.pinned is None:
            raise UpgradeRefused(f"the model {cfg.model.path} is not pinned: give its digest (`appliance model pin "
                                 f"{cfg.model.path}` prints it)")
        if not check.ok:
            raise UpgradeRefused(check.describe())
        if cfg.kernels.lock is not None and cfg.kernels.verify != "off":
            from kernels import lock as kernel_lock

            kc = await asyncio.to_thread(kernel_lock.check, cfg.kernels.lock, cfg.engine.python or None)
            if not kc.ok:
                raise UpgradeRefused(f"{kc.describe()}; give the new engine's own lock (--kernels-lock)")
        try:
            site_plan = await asyncio.to_thread(plan_for_config, cfg)
        except PlanningError as e:
            raise UpgradeRefused(f"cannot plan the new version: {e}") from None
        version = replace(target, model_digest=check.digest)
        return Staged(version, cfg, site_plan, engine_settings(cfg, site_plan.plan).args, check)

    async def _ask_running(self, cases: list[golden.GoldenCase]) -> list[str]:
        cfg = self.state.cfg
        async with golden.EngineAsker(cfg.engine_socket, self.supervisor.internal_key, cfg.served_name,
                                      cfg.upgrade.gate_timeout_s) as asker:
            try:
                return [(await asker.ask(c)).text for c in cases]
            except Exception as e:
                raise UpgradeRefused(f"the running engine did not answer the golden set ({e}); nothing to "
                                     "compare the new model with") from None

    async def _gate(self, a: Attempt, socket: Path, cases: list[golden.GoldenCase],
                    reference: list[str] | None) -> str | None:
        self._step(a, "gate", f"the new engine answers the golden set ({len(cases)} cases)")
        cfg = self.state.cfg
        async with golden.EngineAsker(socket, self.supervisor.internal_key, cfg.served_name,
                                      cfg.upgrade.gate_timeout_s) as asker:
            try:
                answers = await asyncio.wait_for(asyncio.gather(*(asker.ask(c) for c in cases)),
                                                 cfg.upgrade.gate_timeout_s)
            except TimeoutError:
                return f"the golden set took more than upgrade.gate_timeout_s {cfg.upgrade.gate_timeout_s:g}s"
            except Exception as e:
                return f"the new engine did not answer the golden set: {e}"
        verdict = golden.judge(cases, answers, reference, cfg.upgrade.min_agreement)
        a.steps[-1]["verdict"] = verdict.summary()
        return None if verdict.passed else f"golden set: {verdict.summary()}"

    async def _until_serving(self, trial: Trial) -> str | None:
        waiting: set[asyncio.Future[Any]] = {trial.serving, trial.failed}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        return trial.failed.result() if trial.failed.done() else None

    async def _probation(self, trial: Trial) -> str | None:
        u = self.state.cfg.upgrade
        loop = asyncio.get_running_loop()
        end = loop.time() + u.probation_s
        finished0, failed0 = self.metrics.totals["finished"], self.metrics.totals["failed_5xx"]
        while (left := end - loop.time()) > 0:
            done, _ = await asyncio.wait({trial.failed}, timeout=min(left, 1.0))
            if done:
                return f"the new engine failed in probation: {trial.failed.result()}"
            n = self.metrics.totals["finished"] - finished0
            bad = self.metrics.totals["failed_5xx"] - failed0
            if n >= u.probation_min_requests and bad / n > u.probation_max_error_share:
                return (f"{bad} of {n} answers failed (5xx) in probation, more than upgrade.probation_max_error_share "
                        f"{u.probation_max_error_share:g}")
        return None

    async def _rolled_back(self, a: Attempt, reason: str) -> None:
        failed_at = a.step
        where = "the running engine served throughout" if a.mode == "beside" and failed_at != "probation" \
            else f"back to {a.source.describe()}"
        self._step(a, "rollback", f"{where}: {reason}")
        back = await self.supervisor.until_ready(self.state.cfg.engine.startup_timeout_s)
        self._finish(a, "rolled_back", reason if back else f"{reason}; the previous engine did not come back "
                     f"either ({self.supervisor.status.reason})", failed_at)

    # -- bookkeeping -----------------------------------------------------------------------------------

    async def _drain(self, these: set[Any] | None = None) -> None:
        """Let the old engine finish what it answers (`these`: only what was sent to it before a beside switch)."""
        limit = self.state.cfg.upgrade.drain_s
        left = await (self.gateway.drained(limit) if these is None else self.gateway.exchanges.drained_of(these, limit))
        if left:
            log.warning("%d request(s) still running after upgrade.drain_s %gs are cut off by the swap", left, limit)

    def _adopt(self, staged: Staged) -> None:
        """The new engine serves: status, the plan, admission and metrics now speak of it."""
        self._restore(staged.cfg, staged.site_plan, staged.model_check, read_description(staged.cfg.model.path))
        settings = engine_settings(staged.cfg, staged.site_plan.plan)
        if self.admission is not None and settings.admission is not None:
            self.admission.reconfigure(settings.admission)

    def _restore(self, cfg: Any, site_plan: SitePlan, model_check: ModelCheck | None,
                 model_build: dict[str, Any] | None) -> None:
        self.state.cfg, self.state.site_plan, self.state.model_check = cfg, site_plan, model_check
        self.state.model_build = model_build
        self.watch.clear()  # the old engine's samples say nothing about the new one

    def _step(self, a: Attempt, step: str, message: str) -> None:
        a.step = step
        a.steps.append({"step": step, "at": time.time(), "message": message})
        log.warning("%s %s: %s: %s", a.kind, a.id, step, message)
        self.store.write_journal(Journal(a.id, a.kind, step, a.target, a.source, a.started))

    def _finish(self, a: Attempt, result: str, reason: str, step: str | None = None) -> None:
        outcome = Outcome(a.id, a.kind, result, step or a.step, reason, a.target.describe())
        self.store.record(self.file_version, outcome)
        self._counted(a, outcome)

    def _counted(self, a: Attempt, outcome: Outcome) -> None:
        self.metrics.upgrades.labels(a.kind, outcome.result).inc()
        (log.warning if outcome.result == "committed" else log.error)(
            "%s %s %s at %s: %s", a.kind, a.id, outcome.result, outcome.step, outcome.reason)

    def running_version(self) -> Version:
        """What the engine runs, with the digest its folder hashed to at start (a pin may be the manifest's)."""
        v, mc = Version.of(self.state.cfg), self.state.model_check
        return replace(v, model_digest=mc.digest) if mc is not None and not v.model_digest else v

    def show_versions(self) -> None:
        h = self.store.current(self.file_version)
        self.metrics.version_info.clear()
        for role, v in (("current", h.committed if h else self._started_on), ("previous", h.previous if h else None)):
            if v is not None:
                self.metrics.version_info.labels(role, v.model_digest, v.model_path, v.engine_python).set(1)
