"""The doctor's remedies applied by the box itself ([doctor] in the configuration).

Today one: section 8's remedy for decayed speculation. When the engine's drafts stop being accepted,
the engine is relaunched on the plan without speculation, made at start. The relaunch is planned:
new work is refused (503, Retry-After) and the answers in flight finish first, up to
doctor.relaunch_drain_s.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from appliance.api.admission import AdmissionGate
from appliance.api.gateway import Gateway
from appliance.boot.site_state import SiteState
from appliance.engine.args import engine_settings
from appliance.engine.supervisor import EngineSupervisor
from appliance.engine.watch import EngineWatch
from appliance.ops import doctor
from appliance.ops.metrics import Metrics
from kvbudget.plan_types import Plan

log = logging.getLogger("appliance")


@dataclass
class Remedies:
    state: SiteState
    supervisor: EngineSupervisor
    watch: EngineWatch
    gateway: Gateway
    admission: AdmissionGate | None
    metrics: Metrics

    async def run(self) -> None:
        # Runs whatever [doctor] says now: a reload (SIGHUP) may switch acting on or off, or change the interval.
        while True:
            await asyncio.sleep(self.state.cfg.doctor.check_interval_s)
            try:
                await self.act()
            except Exception:  # a bug here must not take the serving daemon down
                log.exception("acting on the doctor's findings failed")

    async def act(self) -> str | None:
        """[doctor] disable_decayed_speculation. Returns what was done, or None.

        The change lasts until the service restarts; the log line tells the operator how to make it permanent.
        """
        state = self.state
        p = state.site_plan.plan
        if not state.cfg.doctor.disable_decayed_speculation or p.speculative.method == "none" \
                or not self.supervisor.ready:
            return None
        finding = doctor.spec_acceptance(self.watch.since(doctor.LIVE_WINDOW_S), p.speculative.method)
        if finding.status != "warn":
            return None
        off = state.site_plan.without_speculation  # planned at start: the probe would crawl on a busy box
        if not isinstance(off, Plan):
            log.error("speculative decoding should go off (%s) but the engine cannot be planned without it: %s",
                      finding.summary, off)
            return None
        action = f"speculative decoding ({p.speculative.method}) turned off: {finding.summary}"
        log.warning("doctor: %s; relaunching the engine without it. Until the service restarts: set "
                    "targets.speculative = \"off\" to keep it off", action)
        state.site_plan = replace(state.site_plan, plan=off, without_speculation=None)
        settings = engine_settings(state.cfg, off)
        if self.admission is not None and settings.admission is not None:
            # the plan without drafts may hold a different number of sequences
            self.admission.reconfigure(settings.admission)
        state.speculation_off = action
        self.metrics.doctor_actions.labels("speculative_off").inc()
        # The old engine's samples say nothing about the new one; poll_once would only notice the reset at
        # the new engine's first sample, and until then the doctor would judge a dead engine's numbers.
        self.watch.clear()
        await self.supervisor.relaunch(settings.args, action, drain=self._drain_local_requests)
        return action

    async def _drain_local_requests(self) -> None:
        """Let the answers the engine is giving finish before it goes: a planned relaunch cuts nobody off."""
        limit = self.state.cfg.doctor.relaunch_drain_s
        busy = self.gateway.local_in_flight
        if busy:
            log.info("waiting up to %gs for %d request(s) in flight to finish before the relaunch", limit, busy)
        left = await self.gateway.drained(limit)
        if left:
            log.warning("%d request(s) still running after %gs are cut off by the relaunch", left, limit)
