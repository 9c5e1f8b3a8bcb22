"""The I/O shell around kvbudget: the configured model and the discovered GPU -> a Plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from appliance.boot.config import Config
from kvbudget import probe
from kvbudget.cpu import FORCE_ENV, CpuIsa, CpuIsaError, host_isa
from kvbudget.gpu import Discovery, discover
from kvbudget.model import ModelError, ModelShape
from kvbudget.model_files import read_draft, read_model
from kvbudget.plan_types import Plan, PlanError, Platform, Targets
from kvbudget.planner import follow_vllm, make_plan, require_modelled
from kvbudget.profiles import GpuProfile, profile_from_discovery


class PlanningError(Exception):
    """The engine cannot be planned for; the message says what to change."""


@dataclass(frozen=True)
class SitePlan:
    plan: Plan
    discovery: Discovery
    asked_vllm: bool = True  # re-plans (reload, the doctor's actions) ask the same way
    # The same targets with speculation off (None when the plan does not speculate), or why that plan
    # cannot run: what the doctor relaunches on when drafts stop paying.
    without_speculation: Plan | PlanError | None = None


def targets_from_config(cfg: Config) -> Targets:
    t = cfg.targets
    return Targets(
        sessions=t.sessions,
        context=cfg.engine.max_model_len or t.context,
        workload=t.workload,
        kv_dtype=t.kv_dtype,
        weights=t.weights,
        fp8_weights_gain=t.fp8_weights_gain,
        ttft_p50_ms=t.ttft_p50_ms,
        tpot_ms=t.tpot_ms,
        speculative=t.speculative,
        prefix_caching=t.prefix_caching,
        tool_call_parser=cfg.engine.tool_call_parser,
        reasoning_parser=cfg.engine.reasoning_parser,
    )


def with_draft(targets: Targets, draft: Path | None) -> Targets:
    """Targets with a local EAGLE-3 draft folder read: its path, exact bytes and KV layers."""
    if draft is None:
        return targets
    d = read_draft(draft)
    return replace(targets, draft_model=str(d.path), draft_model_bytes=d.weight_bytes, draft_layers=d.kv_layers)


def device_for(gpu: GpuProfile | None, platform: Platform, discovered: bool) -> probe.Device:
    """This machine's platform for a GPU found here or the CPU backend of this host's instruction set;
    else the named card or CPU level, emulated."""
    if platform.kind == "cpu":
        return probe.THIS_MACHINE if platform.isa == host_isa() else probe.cpu_host(platform.isa)
    if discovered or gpu is None:
        return probe.THIS_MACHINE
    return probe.Device("cuda", gpu.compute_capability, gpu.name, gpu.memory_bytes)


def with_vllm_figures(plan: Plan, model_path: Path, device: probe.Device, python: str | None) -> Plan:
    """The plan checked by vLLM itself when an engine environment exists (see kvbudget/vllm_probe.py).

    Without one the kvbudget model's figures stand and the plan says so; when vLLM refuses the plan's
    command line, planning fails with vLLM's reason.
    """
    (answer,) = _ask_vllm([plan], model_path, device, python)
    if isinstance(answer, PlanError):
        raise answer
    return answer


def _ask_vllm(plans: list[Plan], model_path: Path, device: probe.Device,
              python: str | None) -> list[Plan | PlanError]:
    """Every plan checked by one probe run (vLLM is imported once): each followed, or vLLM's refusal."""
    def model_only(p: Plan, why: Exception) -> Plan | PlanError:
        try:
            require_modelled(p)
        except PlanError as e:
            return PlanError(f"{e} ({why})")
        return replace(p, notes=(*p.notes, f"figures from the kvbudget model only: {why}"))

    try:
        answers = iter(probe.ask_many(
            [probe.Question(Path(model_path), tuple(p.vllm_args),
                            tuple(c for c in p.sessions_at if c != p.engine.max_model_len))
             for p in plans if p.fits], device, python))
    except probe.ProbeUnavailable as e:
        return [model_only(p, e) for p in plans]
    out: list[Plan | PlanError] = []
    for p in plans:
        a = next(answers) if p.fits else None  # one answer per plan that fits, in order
        if a is None:
            out.append(p)
        elif isinstance(a, probe.VllmRefused):
            out.append(PlanError(str(a)))
        elif isinstance(a, probe.EmulationGap):
            out.append(model_only(p, a))
        else:
            out.append(follow_vllm(p, a))
    return out


def _kvbudget_plan(cfg: Config, model: ModelShape, targets: Targets, discovery: Discovery) -> Plan:
    pool = int(cfg.engine.kv_cache_memory_bytes) if cfg.engine.kv_cache_memory_bytes is not None else None
    if discovery.found:
        gpu = profile_from_discovery(discovery.gpus[0])
        platform = Platform("gpu", gpu_count=len(discovery.gpus),
                            gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                            enforce_eager=cfg.engine.enforce_eager)
        return make_plan(model, gpu, targets, platform, kv_pool_bytes=pool,
                         max_num_seqs=cfg.engine.max_num_seqs)
    if pool is None:
        raise PlanningError(
            f"no GPU found ({discovery.error}); on the CPU backend set engine.kv_cache_memory_bytes "
            "(for example \"1GiB\") so the KV pool is explicit"
        )
    return make_plan(model, None, targets, Platform("cpu", enforce_eager=cfg.engine.enforce_eager, cpu_isa=_host_level()),
                     kv_pool_bytes=pool, max_num_seqs=cfg.engine.max_num_seqs)


def _host_level() -> CpuIsa:
    """This host's instruction-set level; a bad KVBUDGET_HOST_CPU_ISA is a planning error, not a crash."""
    try:
        return host_isa()
    except CpuIsaError as e:
        raise PlanningError(f"{e}: set {FORCE_ENV} to one of them, or unset it to read this host") from None


def plan_for_config(cfg: Config, discovery: Discovery | None = None, ask_vllm: bool = True) -> SitePlan:
    """ask_vllm=False keeps the kvbudget model's figures (for tests of code that only needs a plan).

    When the plan speculates, the same plan without speculation is made beside it (one probe run asks
    vLLM about both): the doctor's remedy for decayed speculation relaunches on it without asking
    vLLM again while the engine has every core busy.
    """
    discovery = discovery or discover()
    try:
        model = read_model(cfg.model.path)
    except ModelError as e:
        raise PlanningError(f"model.path: {e}") from None
    try:
        targets = with_draft(targets_from_config(cfg), cfg.targets.draft_model)
    except ModelError as e:
        raise PlanningError(f"targets.draft_model: {e}") from None
    try:
        plan = _kvbudget_plan(cfg, model, targets, discovery)
        plans = [plan]
        if plan.speculative.method != "none":
            plans.append(_kvbudget_plan(cfg, model, replace(targets, speculative="off"), discovery))
        if ask_vllm:  # the engine runs here: vLLM answers for this machine's own platform
            answered = _ask_vllm(plans, cfg.model.path, probe.THIS_MACHINE, cfg.engine.python or None)
        else:
            answered = [require_modelled(p) for p in plans]
    except PlanError as e:
        raise PlanningError(str(e)) from None
    first = answered[0]
    if isinstance(first, PlanError):
        raise PlanningError(str(first))
    plan = first
    if not plan.fits:
        f = plan.findings[0]
        raise PlanningError(f"the model does not fit: {f.achieved}; " + "; ".join(f.remedies))
    off = answered[1] if len(answered) > 1 else None
    return SitePlan(plan, discovery, ask_vllm, off)
