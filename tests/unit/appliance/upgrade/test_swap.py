"""Beside or in place: the room for a second engine, judged from the plan and what the machine has free."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance.upgrade import swap
from kvbudget.gpu import Discovery, GpuInfo
from kvbudget.plan_types import Memory, Platform

GiB = 1 << 30


def _plan(kind: str, weights: int, kv: int, reserve: int = 0, gpus: int = 1) -> SimpleNamespace:
    return SimpleNamespace(platform=Platform(kind=kind, gpu_count=gpus) if kind == "gpu" else
                           SimpleNamespace(kind="cpu", gpu_count=0),
                           memory=Memory(total=0, headroom=0, weights=weights, draft_weights=0, reserve=reserve,
                                         kv_pool=kv, unused=0))


def _gpu(free: int) -> Discovery:
    card = GpuInfo(index=0, name="NVIDIA L40S", total_bytes=48 * GiB, free_bytes=free, compute_capability=(8, 9),
                   memory_bus_width_bits=384, max_memory_clock_mhz=9001, mig_mode="disabled",
                   other_process_bytes=0)
    return Discovery(gpus=(card,))


def _no_gpu_call() -> Discovery:
    raise AssertionError("a CPU plan must not ask NVML")


def test_cpu_in_place_unless_beside_is_asked_for_and_the_host_has_the_memory(monkeypatch: pytest.MonkeyPatch):
    plan = _plan("cpu", weights=GiB // 4, kv=GiB)
    need = (swap.engine_bytes(plan)) * swap.MARGIN  # type: ignore[arg-type]
    monkeypatch.setattr(swap.psutil, "virtual_memory", lambda: SimpleNamespace(available=int(need) + 1))
    mode, why = swap.choose("auto", plan, _no_gpu_call)  # type: ignore[arg-type]
    assert mode == "in_place" and "same cores" in why
    assert swap.choose("beside", plan, _no_gpu_call) == ("beside", "asked for beside; room for both engines")  # type: ignore[arg-type]
    monkeypatch.setattr(swap.psutil, "virtual_memory", lambda: SimpleNamespace(available=int(need) - GiB))
    mode, why = swap.choose("beside", plan, _no_gpu_call)  # type: ignore[arg-type]
    assert mode == "in_place" and "a second engine needs 4.7 GiB, 3.7 GiB" in why and "host memory available" in why


def test_gpu_beside_only_with_free_memory_for_a_second_engine():
    plan = _plan("gpu", weights=16 * GiB, kv=20 * GiB, reserve=2 * GiB)
    assert swap.choose("auto", plan, lambda: _gpu(44 * GiB))[0] == "beside"  # type: ignore[arg-type]
    mode, why = swap.choose("auto", plan, lambda: _gpu(6 * GiB))  # type: ignore[arg-type]
    assert mode == "in_place" and "6.0 GiB free on NVIDIA L40S" in why
    mode, why = swap.choose("beside", plan, lambda: _gpu(6 * GiB))  # type: ignore[arg-type]
    assert mode == "in_place" and why.startswith("asked for beside, but")
    assert swap.choose("in_place", plan, lambda: _gpu(44 * GiB))[0] == "in_place"  # type: ignore[arg-type]
    mode, why = swap.choose("auto", plan, lambda: Discovery(error="no NVIDIA driver"))  # type: ignore[arg-type]
    assert mode == "in_place" and "no NVIDIA driver" in why


def test_an_engine_over_several_gpus_swaps_in_place():
    plan = _plan("gpu", weights=16 * GiB, kv=20 * GiB, gpus=2)
    mode, why = swap.choose("auto", plan, lambda: _gpu(80 * GiB))  # type: ignore[arg-type]
    assert mode == "in_place" and "several GPUs" in why


def test_the_cpu_estimate_counts_the_engine_processes():
    plan = _plan("cpu", weights=GiB, kv=2 * GiB)
    assert swap.engine_bytes(plan) == 3 * GiB + swap.CPU_ENGINE_OVERHEAD  # type: ignore[arg-type]
    assert swap.engine_bytes(_plan("gpu", weights=GiB, kv=2 * GiB, reserve=GiB)) == 4 * GiB  # type: ignore[arg-type]
