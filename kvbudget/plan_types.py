"""What a plan is made of: the site's targets, the platform, and the Plan itself (plain data).

kvbudget.planner makes plans; kvbudget.render shows them; appliance code reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, get_args

from kvbudget.accounting import (
    CPU_DEFAULT_BLOCK_SIZE,
    GPU_DEFAULT_BLOCK_SIZE,
    EngineShape,
    KvCapacity,
    KvDtype,
    KvLayout,
)
from kvbudget.cpu import CpuIsa
from kvbudget.model import ModelShape
from kvbudget.probe import VllmFigures
from kvbudget.profiles import GpuProfile
from kvbudget.tools import ToolCalling
from kvbudget.weights import WeightChoice, WeightTarget

Workload = Literal["chat", "code", "long-context", "tool-calling"]
WORKLOADS: tuple[Workload, ...] = get_args(Workload)
SpeculativeTarget = Literal["auto", "off"]  # off: the operator (or the doctor's advice) turned it off


@dataclass(frozen=True)
class Targets:
    sessions: int | None = None
    context: int | None = None
    workload: Workload = "chat"
    kv_dtype: KvDtype = "auto"  # auto: FP8 where the GPU or the CPU host supports it, else the model's dtype
    weights: WeightTarget = "auto"  # auto: FP8 at load on an FP8 card when it fits or pays (kvbudget.weights)
    fp8_weights_gain: float = 0.25  # the share more sessions that makes `auto` take FP8 weights
    ttft_p50_ms: float | None = None
    tpot_ms: float | None = None
    max_num_batched_tokens: int | None = None  # default: 8192 on GPU, 2048 on the CPU backend (passed explicitly)
    draft_model_bytes: int | None = None  # an EAGLE draft the site provides (bytes), enables EAGLE
    num_speculative_tokens: int | None = None
    speculative: SpeculativeTarget = "auto"
    prefix_caching: bool = True  # vLLM's default; off trades cache hits for fewer state blocks on hybrids
    draft_model: str | None = None  # a local EAGLE-3 folder; its path goes into --speculative-config
    draft_layers: int | None = None  # KV layers the draft adds (counted from its config.json)
    tool_call_parser: str = "auto"  # auto: from the model (kvbudget.tools); "none"; or a vLLM parser name
    reasoning_parser: str = "auto"


@dataclass(frozen=True)
class Platform:
    kind: Literal["gpu", "cpu"] = "gpu"
    gpu_count: int = 1
    gpu_memory_utilization: float = 0.92  # vLLM's default: what it holds back is headroom
    enforce_eager: bool = False
    # The CPU backend's host (kvbudget.cpu): what vLLM's CPU platform runs there. Required for a CPU plan
    # (no default: a plan that assumed one host's level would be wrong on the others); the planning shells
    # read it from the host, what-if plans name it.
    cpu_isa: CpuIsa | None = None

    @property
    def isa(self) -> CpuIsa:
        """The CPU host's level, for a CPU plan (refused without one)."""
        if self.cpu_isa is None:
            raise PlanError("the CPU backend's plan depends on the host's instruction set: give cpu_isa "
                            "(kvbudget.cpu.host_isa() reads this host's)")
        return self.cpu_isa

    @property
    def block_size(self) -> int:
        return CPU_DEFAULT_BLOCK_SIZE if self.kind == "cpu" else GPU_DEFAULT_BLOCK_SIZE

    def batched_tokens(self, targets: Targets) -> int:
        return targets.max_num_batched_tokens or (2048 if self.kind == "cpu" else 8192)


@dataclass(frozen=True)
class Memory:
    total: int
    headroom: int  # what gpu_memory_utilization keeps back
    weights: int
    draft_weights: int
    reserve: int  # activation peak + CUDA context + CUDA graphs (estimated)
    kv_pool: int  # exact bytes passed as --kv-cache-memory-bytes (whole blocks)
    unused: int  # the remainder below one block


@dataclass(frozen=True)
class Speculative:
    method: Literal["none", "ngram", "eagle3", "mtp"]
    num_speculative_tokens: int
    reason: str

    draft_model: str | None = None

    def config_json(self) -> str | None:
        if self.method == "none":
            return None
        cfg: dict[str, object] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        # n-gram: vLLM's own lookup window (SpeculativeConfig: prompt_lookup_min = max = 5) is left as it is;
        # no measurement here says another window accepts more.
        if self.method == "eagle3":
            if not self.draft_model:
                raise PlanError("EAGLE-3 needs the draft's local folder (targets.draft_model)")
            cfg["model"] = self.draft_model
        return json.dumps(cfg, separators=(",", ":"))


@dataclass(frozen=True)
class Finding:
    target: str
    wanted: str
    achieved: str
    shortfall_pct: float
    remedies: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    gpu: GpuProfile
    model: ModelShape
    targets: Targets
    platform: Platform
    fits: bool
    memory: Memory
    engine: EngineShape
    layout: KvLayout | None
    capacity: KvCapacity | None
    sessions_at: dict[int, float]
    max_num_seqs: int
    speculative: Speculative
    tpot_floor_ms: float | None
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]
    vllm_args: tuple[str, ...]
    source: str = "kvbudget model"  # or "vllm X.Y.Z" when vLLM's own figures replaced the model's
    vllm: VllmFigures | None = None
    model_figures: KvCapacity | None = None  # the kvbudget model's figures, kept when vLLM's replaced them
    disagreements: tuple[str, ...] = ()
    tools: ToolCalling | None = None  # tool-calling and reasoning parsers (kvbudget.tools); None: did not fit
    weights: WeightChoice | None = None  # how the engine holds the weights (kvbudget.weights)
    kv_dtype_why: str | None = None  # why the KV dtype is what it is, where that depends on the device

    @property
    def targets_met(self) -> bool:
        return self.fits and not self.findings


class PlanError(ValueError):
    pass
