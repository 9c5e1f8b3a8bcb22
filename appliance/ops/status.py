"""GET /v1/appliance/status and /v1/appliance/doctor: what a fleet operator compares across sites."""

from __future__ import annotations

import asyncio
from typing import Any

from appliance import __version__
from appliance.boot.site_state import SiteState
from appliance.engine.supervisor import EngineSupervisor
from appliance.engine.watch import EngineWatch
from appliance.ops import doctor
from appliance.ops.traffic import TrafficWatch
from appliance.upgrade.upgrader import Upgrader
from cascade.service import Cascade


def status(state: SiteState, supervisor: EngineSupervisor, cascade: Cascade | None,
           upgrader: Upgrader | None = None) -> dict[str, Any]:
    """Version, engine state, model digest and pin, plan summary, devices, kernels, cascade, upgrades."""
    cfg, mc, kc, p = state.cfg, state.model_check, state.kernel_check, state.site_plan.plan
    return {
        "upgrade": upgrader.status() if upgrader is not None else None,
        "site": cfg.site.name,
        "version": __version__,
        "engine": supervisor.status.as_dict(),
        "model": {
            "served_name": cfg.served_name,
            "path": str(cfg.model.path),
            "digest": mc.digest if mc else None,
            "pinned": mc.pinned if mc else None,
            "matches_pin": mc.ok if mc and mc.pinned else None,
            "weights": {"format": p.model.weight_format or None,
                        "scheme": state.model_build.get("scheme") if state.model_build else None,
                        # vLLM's own FP8 quantization of a 16-bit checkpoint as it loads it (kvbudget.weights)
                        "quantized_at_load": "fp8" if p.weights and p.weights.scheme == "fp8" else None,
                        "why": p.weights.reason if p.weights else None},
        },
        "plan": {"kv_pool_bytes": p.memory.kv_pool, "max_model_len": p.engine.max_model_len,
                 "kv_cache_dtype": p.engine.kv_dtype if p.engine.kv_dtype != "auto" else "model dtype",
                 "kv_cache_dtype_why": p.kv_dtype_why,
                 "max_num_seqs": p.max_num_seqs,
                 "speculative": {"method": p.speculative.method,
                                 "reason": state.speculation_off or p.speculative.reason},
                 "kv_tokens": p.capacity.tokens_reported if p.capacity else None,
                 "targets_met": p.targets_met},
        "devices": state.site_plan.discovery.as_dict(),
        "kernels": {"lock": kc.lock_path, "digest": kc.digest, "matches_lock": kc.ok,
                    "mismatches": [str(m).strip() for m in kc.mismatches[:50]], "error": kc.error}
        if kc is not None else {"lock": None},
        "cascade": cascade.status() if cascade is not None else {"configured": False},
    }


def live_findings(state: SiteState, supervisor: EngineSupervisor, watch: EngineWatch,
                  traffic: TrafficWatch | None = None, cascade: Cascade | None = None,
                  upgrader: Upgrader | None = None) -> list[doctor.Finding]:
    """The engine's state and the recipes over the last half hour of engine and traffic samples: no I/O,
    so the metrics export them at every scrape (appliance_doctor_finding) as well as the doctor route."""
    st = supervisor.status
    p = state.site_plan.plan
    live = [doctor.engine_state(st.state.value, st.reason, st.restarts),
            *doctor.recipes(watch.since(doctor.LIVE_WINDOW_S),
                            traffic.since(doctor.LIVE_WINDOW_S) if traffic is not None else [],
                            capacity=p.max_num_seqs, spec_method=p.speculative.method,
                            workload=state.cfg.targets.workload,
                            escalation_share_max=state.cfg.doctor.grow_escalation_share,
                            regional_enabled=state.cfg.regional.enabled)]
    if cascade is not None:
        live.append(doctor.calibrator(cascade.status()["calibrator"]))
    if upgrader is not None:
        live.append(doctor.upgrade(upgrader.status()))
    return live


async def doctor_report(state: SiteState, supervisor: EngineSupervisor, watch: EngineWatch,
                        traffic: TrafficWatch | None = None, cascade: Cascade | None = None,
                        upgrader: Upgrader | None = None) -> dict[str, Any]:
    """The setup checks (the model hashed at start, not again) and the live findings."""
    setup = await asyncio.to_thread(doctor.setup_checks, state.cfg, state.site_plan.discovery, state.model_check,
                                    state.kernel_check)
    return doctor.as_dict([*setup, *live_findings(state, supervisor, watch, traffic, cascade, upgrader)])
