"""appliance plan (the KV budget and vLLM settings) and appliance gpus (what NVML finds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from appliance.cli.common import EXIT_FAILED, CliError, choice, config_option, load_config, size
from kvbudget.accounting import KvDtype
from kvbudget.cpu import CPU_ISAS
from kvbudget.plan_types import Platform, Workload
from kvbudget.profiles import GpuProfile
from kvbudget.weights import WeightTarget


@click.command("plan")
@config_option
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="Model folder or config.json (default: model.path from --config).")
@click.option("--gpu", "gpu_name", default=None,
              help='A named GPU profile, e.g. "RTX PRO 6000 Blackwell" (default: the GPU found by NVML).')
@click.option("--gpu-memory", default=None, help="Plan for a card of this much memory, e.g. 96GiB.")
@click.option("--gpu-cc", default="8.0", show_default=True, help="Compute capability of a --gpu-memory card.")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 64), help="GPUs (tensor parallel).")
@click.option("--cpu", "cpu_backend", is_flag=True, help="Plan for vLLM's CPU backend (needs --kv-pool).")
@click.option("--cpu-isa", type=click.Choice(CPU_ISAS), default=None,
              help="With --cpu: plan for a host of this instruction set (default: this host's, from /proc/cpuinfo).")
@click.option("--kv-pool", default=None, help="Fix the KV pool (bytes or e.g. 1GiB) instead of deriving it.")
@click.option("--sessions", type=click.IntRange(min=1), default=None, help="Concurrent sessions wanted.")
@click.option("--context", type=click.IntRange(min=16), default=None, help="Context per session, tokens.")
@click.option("--workload", type=choice(Workload), default=None)
@click.option("--kv-dtype", type=choice(KvDtype), default=None)
@click.option("--weights", type=choice(WeightTarget), default=None,
              help="Weight precision: auto (FP8 at load on an FP8 card when it fits or pays), model (as stored), "
                   "fp8 (vLLM quantizes at load).")
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), default=None, help="p50 TTFT target.")
@click.option("--tpot-ms", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Time per output token target.")
@click.option("--draft-model", type=click.Path(path_type=Path), default=None,
              help="A local EAGLE-3 draft folder (enables EAGLE; its bytes and layers are read from it).")
@click.option("--prefix-caching", type=click.Choice(["on", "off"]), default=None,
              help="vLLM's prefix cache (default on; off fits more sessions of hybrid models).")
@click.option("--engine-python", default=None, help="The engine environment's interpreter (default: engine.python, "
              "else this one when vLLM is installed here).")
@click.option("--model-only", is_flag=True, help="Use the kvbudget model alone; do not ask vLLM (faster, no engine).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan_cmd(config_path, model_path, gpu_name, gpu_memory, gpu_cc, gpus, cpu_backend, cpu_isa, kv_pool, sessions, context,
             workload, kv_dtype, weights, ttft_ms, tpot_ms, draft_model, prefix_caching, engine_python, model_only,
             as_json) -> None:
    """Compute the KV budget and the vLLM settings for a model on a GPU, against the site's targets.

    When an engine environment exists, vLLM itself checks the plan's command line and its figures
    replace the kvbudget model's (the plan names its source). Exit 0 when every target is met, 1 when a
    target is missed or the model does not fit (the plan says by how much and what would help), 2 for
    bad input or a plan vLLM refuses.
    """
    from appliance.boot.planning import device_for, targets_from_config, with_draft, with_vllm_figures
    from kvbudget.model import ModelError
    from kvbudget.model_files import read_model
    from kvbudget.plan_types import PlanError, Targets
    from kvbudget.planner import make_plan, require_modelled
    from kvbudget.profiles import UnknownGpu
    from kvbudget.render import plan_dict, plan_text

    cfg = load_config(config_path) if config_path or (model_path is None) else None
    path = model_path or (cfg.model.path if cfg else None)
    if path is None:
        raise click.UsageError("give --model (or --config with model.path)")
    base = targets_from_config(cfg) if cfg else Targets()
    targets = Targets(
        sessions=sessions or base.sessions, context=context or base.context, workload=workload or base.workload,
        kv_dtype=kv_dtype or base.kv_dtype, weights=weights or base.weights,
        fp8_weights_gain=base.fp8_weights_gain, ttft_p50_ms=ttft_ms or base.ttft_p50_ms, tpot_ms=tpot_ms or base.tpot_ms,
        speculative=base.speculative,
        prefix_caching=base.prefix_caching if prefix_caching is None else prefix_caching == "on",
    )
    try:
        targets = with_draft(targets, draft_model or (cfg.targets.draft_model if cfg else None))
        model = read_model(path)
        pool = size(kv_pool) if kv_pool else (
            int(cfg.engine.kv_cache_memory_bytes) if cfg and cfg.engine.kv_cache_memory_bytes else None)
        if cpu_isa and not cpu_backend:
            raise click.UsageError("--cpu-isa plans for the CPU backend: give --cpu with it")
        gpu, platform, discovered = _device(cpu_backend, cpu_isa, gpu_name, gpu_memory, gpu_cc, gpus)
        plan = make_plan(model, gpu, targets, platform, kv_pool_bytes=pool,
                         max_num_seqs=cfg.engine.max_num_seqs if cfg else None)
        if model_only:
            plan = require_modelled(plan)
        else:
            python = engine_python or (cfg.engine.python if cfg else None) or None
            plan = with_vllm_figures(plan, path, device_for(gpu, platform, discovered), python)
    except (ModelError, PlanError, UnknownGpu, ValueError) as e:
        raise CliError(str(e)) from None
    click.echo(json.dumps(plan_dict(plan), indent=2) if as_json else plan_text(plan))
    sys.exit(0 if plan.targets_met else EXIT_FAILED)


def _device(cpu_backend: bool, cpu_isa: str | None, gpu_name: str | None, gpu_memory: str | None, gpu_cc: str,
            gpus: int) -> tuple[GpuProfile | None, Platform, bool]:
    """What to plan for: the CPU backend (this host's level, or --cpu-isa), a named card, a card of a given
    memory, or the GPU NVML finds here (the last says it was discovered: vLLM is then asked about it as is)."""
    from kvbudget.cpu import check_isa, host_isa
    from kvbudget.gpu import discover
    from kvbudget.profiles import custom_profile, find_profile, profile_from_discovery

    if cpu_backend:
        return None, Platform("cpu", cpu_isa=check_isa(cpu_isa) if cpu_isa else host_isa()), False
    if gpu_name:
        return find_profile(gpu_name), Platform("gpu", gpu_count=gpus), False
    if gpu_memory:
        major, _, minor = gpu_cc.partition(".")
        return custom_profile(size(gpu_memory) or 0, (int(major), int(minor or 0))), Platform("gpu", gpu_count=gpus), False
    found = discover()
    if not found.found:
        raise CliError(f"{found.error}; name a GPU with --gpu (for example \"RTX PRO 6000 Blackwell\"), "
                       "give --gpu-memory, or plan for --cpu")
    return (profile_from_discovery(found.gpus[0]), Platform("gpu", gpu_count=len(found.gpus) if gpus == 1 else gpus),
            True)


@click.command("gpus")
@click.option("--json", "as_json", is_flag=True)
def gpus_cmd(as_json: bool) -> None:
    """What NVML finds: every GPU's memory, compute capability, bandwidth, MIG mode, other processes."""
    from kvbudget.gpu import discover

    d = discover()
    if as_json:
        click.echo(json.dumps(d.as_dict(), indent=2))
    elif not d.found:
        click.echo(f"no GPU: {d.error}")
    else:
        click.echo(f"driver {d.driver_version}, CUDA {d.cuda_version}")
        for g in d.gpus:
            bw = f"{g.peak_bandwidth_bytes_s / 1e9:,.0f} GB/s" if g.peak_bandwidth_bytes_s else "bandwidth unknown"
            click.echo(f"  [{g.index}] {g.name}: {g.total_bytes / 2**20:,.0f} MiB total, "
                       f"{g.free_bytes / 2**20:,.0f} MiB free, cc {g.compute_capability[0]}.{g.compute_capability[1]}, "
                       f"{bw}, MIG {g.mig_mode}, other processes {g.other_process_bytes / 2**20:,.0f} MiB")
    for p in d.problems:
        click.echo(f"  problem: {p}", err=True)
    sys.exit(0 if d.found else EXIT_FAILED)
