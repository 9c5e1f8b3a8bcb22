"""kvbudget.cpu: the host's instruction-set level read off /proc/cpuinfo, and the CPU rules each level brings
to a plan (checked against vLLM itself, level by level, in tests/integration/test_kvbudget_vs_vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbudget.cpu import FORCE_ENV, CpuIsaError, check_isa, host_isa, isa_from_flags
from kvbudget.model_files import read_model
from kvbudget.plan_types import PlanError, Platform, Targets
from kvbudget.planner import make_plan

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "models"
GiB = 1 << 30
BASE = "fpu vme de pse tsc msr pae sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2"
# The flags lines of four kinds of host (trimmed to what matters and some of what surrounds it).
HOSTS = {
    "avx2": BASE + " adx smap clflushopt sha_ni",  # Zen 2, Comet Lake
    "avx512": BASE + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni",  # Cascade Lake
    "avx512-bf16": BASE + " avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni",  # Zen 4
    "amx": BASE + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8",
}


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n"
                 f"processor\t: 1\nflags\t\t: {flags}\n")
    return f


@pytest.mark.parametrize("isa", list(HOSTS))
def test_each_kind_of_host_reads_as_its_level(tmp_path, monkeypatch, isa):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    assert host_isa(_cpuinfo(tmp_path, HOSTS[isa])) == isa


def test_avx512_needs_all_four_of_pytorchs_flags():
    # Xeon Phi (Knights Landing) has avx512f and avx512cd but not vl/bw/dq: PyTorch says no AVX-512.
    assert isa_from_flags(frozenset(BASE.split()) | {"avx512f", "avx512cd", "avx512er", "avx512pf"}) == "avx2"
    assert isa_from_flags(frozenset(BASE.split()) | {"avx512f", "avx512vl", "avx512bw", "avx512dq"}) == "avx512"


def test_the_level_can_be_forced_and_a_bad_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "amx")
    assert host_isa(_cpuinfo(tmp_path, HOSTS["avx2"])) == "amx"
    monkeypatch.setenv(FORCE_ENV, "avx1024")
    with pytest.raises(CpuIsaError, match=r"unknown CPU instruction set 'avx1024'.*avx2, avx512, avx512-bf16, amx"):
        host_isa()
    monkeypatch.delenv(FORCE_ENV)
    assert host_isa(tmp_path / "missing") == "avx2"  # no cpuinfo: the level every x86-64 build runs on
    assert check_isa("avx512-bf16") == "avx512-bf16"


def _plan(name: str, isa: str, **targets):
    return make_plan(read_model(FIX / f"{name}.json"), None, Targets(context=8192, **targets),
                     Platform("cpu", cpu_isa=isa), kv_pool_bytes=GiB)


def test_fp8_kv_follows_avx512_and_falls_back_with_the_reason():
    assert _plan("smollm2-135m-instruct", "avx512", kv_dtype="fp8").engine.kv_dtype == "fp8"
    avx2 = _plan("smollm2-135m-instruct", "avx2", kv_dtype="fp8")
    assert avx2.engine.kv_dtype == "auto" and "--kv-cache-dtype" not in avx2.vllm_args
    assert any("needs AVX-512 or AMX" in n and "avx2" in n for n in avx2.notes)
    # auto takes FP8 where vLLM's CPU attention has it, and says why; where it has not, the model dtype and why
    for isa in ("avx512", "avx512-bf16", "amx"):
        auto = _plan("smollm2-135m-instruct", isa)
        assert auto.engine.kv_dtype == "fp8" and "--kv-cache-dtype" in auto.vllm_args
        assert auto.kv_dtype_why and f"on this {isa} host" in auto.kv_dtype_why
        assert auto.capacity.tokens_reported == 2 * _plan("smollm2-135m-instruct", isa, kv_dtype="bf16") \
            .capacity.tokens_reported
    auto2 = _plan("smollm2-135m-instruct", "avx2")
    assert auto2.engine.kv_dtype == "auto" and "--kv-cache-dtype" not in auto2.vllm_args
    assert auto2.kv_dtype_why and "needs AVX-512 or AMX" in auto2.kv_dtype_why
    kept = _plan("smollm2-135m-instruct", "amx", kv_dtype="bf16")
    assert kept.engine.kv_dtype == "auto" and "--kv-cache-dtype" not in kept.vllm_args
    mla = _plan("deepseek-v2-lite-chat", "amx", kv_dtype="fp8")
    assert mla.engine.kv_dtype == "auto" and any("16-bit latent cache" in n for n in mla.notes)


def test_mla_follows_amx():
    amx, avx512 = _plan("deepseek-v2-lite-chat", "amx"), _plan("deepseek-v2-lite-chat", "avx512-bf16")
    assert amx.layout.block_size == 128 and amx.targets.prefix_caching
    assert avx512.layout.block_size == 16 and not avx512.targets.prefix_caching
    assert "--no-enable-prefix-caching" in avx512.vllm_args


def test_weights_without_a_cpu_kernel_are_refused_by_name():
    with pytest.raises(PlanError, match=r"MXFP4 MoE weights need AMX.*avx512-bf16"):
        _plan("gpt-oss-20b", "avx512-bf16")
    assert _plan("gpt-oss-20b", "amx").fits
    with pytest.raises(PlanError, match="block-scaled FP8 weights need AMX"):
        _plan("qwen3.6-27b-fp8", "avx2")
    with pytest.raises(PlanError, match="NVFP4 weights have no kernel"):
        _plan("llama-3.1-8b-instruct-nvfp4", "amx")
    fp8 = _plan("llama-3.1-8b-instruct-fp8-dynamic", "avx2")  # per-channel FP8 runs everywhere, slowly
    assert fp8.fits and any("per-channel FP8 weights" in n and "w8a8-int8" in n for n in fp8.notes)
    assert not any("per-channel FP8" in n for n in _plan("qwen3.6-27b-fp8", "amx").notes)  # AMX's block kernel


def test_the_daemon_plans_for_the_host_s_level_and_a_bad_forced_one_is_a_planning_error(tmp_path, monkeypatch):
    """plan_for_config on a CPU host (no GPU found) reads the host's level; a KVBUDGET_HOST_CPU_ISA that
    names no level is a PlanningError naming the variable (start-up prints it in one line), not a crash."""
    from appliance.boot import config
    from appliance.boot.planning import PlanningError, plan_for_config
    from kvbudget.gpu import Discovery

    cfg = config.parse(f'[model]\npath = "{FIX / "deepseek-v2-lite-chat.json"}"\n[state]\ndirectory = "{tmp_path}"\n'
                       '[engine]\nkv_cache_memory_bytes = "1GiB"\n')
    no_gpu = Discovery(error="no NVIDIA driver")
    monkeypatch.setenv(FORCE_ENV, "amx")
    plan = plan_for_config(cfg, no_gpu, ask_vllm=False).plan
    assert plan.platform.cpu_isa == "amx" and plan.layout.block_size == 128  # AMX_MLA's blocks
    monkeypatch.setenv(FORCE_ENV, "avx1024")
    with pytest.raises(PlanningError, match=r"unknown CPU instruction set 'avx1024'.*set KVBUDGET_HOST_CPU_ISA"):
        plan_for_config(cfg, no_gpu, ask_vllm=False)
