"""The I/O shell around kvbudget: the configured model and the discovered GPU -> a Plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from appliance.config import Config
from kvbudget import probe
from kvbudget.gpu import Discovery, discover
from kvbudget.model import ModelError, read_draft, read_model
from kvbudget.planner import Plan, PlanError, Platform, Targets, follow_vllm, make_plan
from kvbudget.profiles import GpuProfile, profile_from_discovery


class PlanningError(Exception):
    """The engine cannot be planned for; the message says what to change."""


@dataclass(frozen=True)
class SitePlan:
    plan: Plan
    discovery: Discovery
    asked_vllm: bool = True  # re-plans (reload, the doctor's actions) ask the same way


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
        prefix_caching=t.prefix_caching,
    )


def with_draft(targets: Targets, draft: Path | None) -> Targets:
    """Targets with a local EAGLE-3 draft folder read: its path, exact bytes and KV layers."""
    if draft is None:
        return targets
    d = read_draft(draft)
    return replace(targets, draft_model=str(d.path), draft_model_bytes=d.weight_bytes, draft_layers=d.kv_layers)


def device_for(gpu: GpuProfile | None, platform: Platform, discovered: bool) -> probe.Device:
    """This machine's platform for the CPU backend or a GPU found here; else the named card, emulated."""
    if platform.kind == "cpu" or discovered or gpu is None:
        return probe.THIS_MACHINE
    return probe.Device("cuda", gpu.compute_capability, gpu.name, gpu.memory_bytes)


def with_vllm_figures(plan: Plan, model_path: Path, device: probe.Device, python: str | None) -> Plan:
    """The plan checked by vLLM itself when an engine environment exists (see kvbudget/vllm_probe.py).

    Without one the kvbudget model's figures stand and the plan says so; when vLLM refuses the plan's
    command line, planning fails with vLLM's reason.
    """
    if not plan.fits:
        return plan
    try:
        figures = probe.ask(model_path, plan.vllm_args, device, python,
                            contexts=tuple(c for c in plan.sessions_at if c != plan.engine.max_model_len))
    except probe.ProbeUnavailable as e:
        return replace(plan, notes=plan.notes + (f"figures from the kvbudget model only: {e}",))
    except probe.VllmRefused as e:
        raise PlanError(str(e)) from None
    return follow_vllm(plan, figures)


def plan_for_config(cfg: Config, discovery: Discovery | None = None, ask_vllm: bool = True) -> SitePlan:
    """ask_vllm=False keeps the kvbudget model's figures (for tests of code that only needs a plan)."""
    discovery = discovery or discover()
    try:
        model = read_model(cfg.model.path)
    except ModelError as e:
        raise PlanningError(f"model.path: {e}") from None
    try:
        targets = with_draft(targets_from_config(cfg), cfg.targets.draft_model)
    except ModelError as e:
        raise PlanningError(f"targets.draft_model: {e}") from None
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
        if ask_vllm:  # the engine runs here: vLLM answers for this machine's own platform
            plan = with_vllm_figures(plan, cfg.model.path, probe.THIS_MACHINE, cfg.engine.python or None)
    except PlanError as e:
        raise PlanningError(str(e)) from None
    if not plan.fits:
        f = plan.findings[0]
        raise PlanningError(f"the model does not fit: {f.achieved}; " + "; ".join(f.remedies))
    return SitePlan(plan, discovery, ask_vllm)
