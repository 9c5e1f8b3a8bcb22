"""The I/O shell around kvbudget: the configured model and the discovered GPU -> a Plan."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config import Config
from kvbudget.gpu import Discovery, discover
from kvbudget.model import ModelError, read_model
from kvbudget.planner import Plan, PlanError, Platform, Targets, make_plan
from kvbudget.profiles import profile_from_discovery


class PlanningError(Exception):
    """The engine cannot be planned for; the message says what to change."""


@dataclass(frozen=True)
class SitePlan:
    plan: Plan
    discovery: Discovery


def targets_from_config(cfg: Config) -> Targets:
    t = cfg.targets
    return Targets(
        sessions=t.sessions,
        context=cfg.engine.max_model_len or t.context,
        workload=t.workload,
        kv_dtype=t.kv_dtype,
        ttft_p50_ms=t.ttft_p50_ms,
        tpot_ms=t.tpot_ms,
        speculative=t.speculative,
    )


def plan_for_config(cfg: Config, discovery: Discovery | None = None) -> SitePlan:
    discovery = discovery or discover()
    try:
        model = read_model(cfg.model.path)
    except ModelError as e:
        raise PlanningError(f"model.path: {e}") from None
    targets = targets_from_config(cfg)
    pool = int(cfg.engine.kv_cache_memory_bytes) if cfg.engine.kv_cache_memory_bytes is not None else None
    try:
        if discovery.found:
            gpu = profile_from_discovery(discovery.gpus[0])
            platform = Platform("gpu", gpu_count=len(discovery.gpus),
                                gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                                enforce_eager=cfg.engine.enforce_eager)
            plan = make_plan(model, gpu, targets, platform, kv_pool_bytes=pool, max_num_seqs=cfg.engine.max_num_seqs)
        else:
            if pool is None:
                raise PlanningError(
                    f"no GPU found ({discovery.error}); on the CPU backend set engine.kv_cache_memory_bytes "
                    "(for example \"1GiB\") so the KV pool is explicit"
                )
            plan = make_plan(model, None, targets, Platform("cpu", enforce_eager=cfg.engine.enforce_eager),
                             kv_pool_bytes=pool, max_num_seqs=cfg.engine.max_num_seqs)
    except PlanError as e:
        raise PlanningError(str(e)) from None
    if not plan.fits:
        f = plan.findings[0]
        raise PlanningError(f"the model does not fit: {f.achieved}; " + "; ".join(f.remedies))
    return SitePlan(plan, discovery)
