"""Run kvbudget/vllm_probe.py in the engine's interpreter and read vLLM's own KV figures.

The planner's process never imports vLLM: the probe runs in whichever interpreter has it (engine.python,
or this one when vLLM is installed beside the appliance), the way kernels/scan.py does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBE_SCRIPT = Path(__file__).with_name("vllm_probe.py")
PROBE_TIMEOUT_S = 300


class ProbeUnavailable(RuntimeError):
    """No interpreter with vLLM: plan with the kvbudget model alone."""


class EmulationGap(ProbeUnavailable):
    """Emulating a named card reached a real CUDA call: no answer from vLLM for that card here."""


class VllmRefused(ValueError):
    """vLLM itself refuses this model or command line; the message is vLLM's."""


@dataclass(frozen=True)
class Device:
    """Where the engine will run: this machine's own platform, a CPU host of a named instruction-set level
    (kvbudget.cpu; vLLM is given PyTorch's answers for it), or an NVIDIA card named by its compute
    capability (emulated by vLLM's CUDA platform class on a machine that lacks it)."""

    platform: str = "current"  # "current", "cpu" or "cuda"
    compute_capability: tuple[int, int] | None = None
    name: str = ""
    memory_bytes: int = 0
    isa: str = ""  # the CPU host's level, for platform "cpu"

    def as_request(self) -> dict[str, Any]:
        if self.platform == "current":
            return {"platform": "current"}
        if self.platform == "cpu":
            return {"platform": "cpu", "isa": self.isa}
        return {"platform": "cuda", "compute_capability": list(self.compute_capability or (8, 0)),
                "name": self.name, "memory_bytes": self.memory_bytes}


THIS_MACHINE = Device()


def cpu_host(isa: str) -> Device:
    return Device("cpu", isa=isa)


@dataclass(frozen=True)
class VllmGroup:
    type: str  # vLLM's spec class: FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec, ...
    groups: int  # how many KV cache groups of this shape vLLM made
    layers: int  # layers per group
    block_size: int
    page_size_bytes: int
    blocks_per_request: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    state_bytes: int | None = None  # a Mamba/linear-attention state before page padding


@dataclass(frozen=True)
class VllmFigures:
    """What vLLM computes for one command line: its block size, groups, blocks and capacity."""

    vllm_version: str
    platform: str
    attention_backends: tuple[str, ...]
    block_size: int
    kv_cache_dtype: str
    mamba_cache_mode: str | None
    enable_prefix_caching: bool
    groups: tuple[VllmGroup, ...]
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float
    kv_tokens: int
    sessions_at: dict[int, float]
    kv_layers: int
    seconds: float
    notes: tuple[str, ...] = field(default=())
    cpu_isa: str | None = None  # the CPU level vLLM answered for (None on a GPU)
    backend_kv_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # what each backend declares

    @property
    def source(self) -> str:
        return f"vllm {self.vllm_version}"

    @property
    def group_count(self) -> int:
        return sum(g.groups for g in self.groups)

    @property
    def page_bytes(self) -> int:
        """The pool's page: vLLM unifies every group's page to the largest."""
        return max(g.page_size_bytes for g in self.groups)


def engine_python(configured: str | None = None) -> str:
    """The interpreter that has vLLM: engine.python when set, else this one when vLLM is importable here."""
    if configured:
        if not os.access(configured, os.X_OK):
            raise ProbeUnavailable(f"engine.python {configured} is not an executable interpreter")
        return configured
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ProbeUnavailable("vLLM is not installed in this environment and engine.python is not set")


def _figures(answer: dict[str, Any]) -> VllmFigures:
    if answer.get("stage") == "emulation":
        raise EmulationGap(f"vLLM could not be asked about the named card on this machine: {answer.get('error')}")
    if not answer.get("ok"):
        raise VllmRefused(f"vLLM refuses this plan ({answer.get('stage', '?')}): {answer.get('error')}")
    groups = tuple(VllmGroup(
        type=g["type"], groups=g["groups"], layers=g["layers"], block_size=g["block_size"],
        page_size_bytes=g["page_size_bytes"], blocks_per_request=g["blocks_per_request"],
        sliding_window=g.get("sliding_window"), attention_chunk_size=g.get("attention_chunk_size"),
        state_bytes=g.get("state_bytes")) for g in answer["groups"])
    return VllmFigures(
        vllm_version=answer["vllm_version"], platform=answer["platform"],
        attention_backends=tuple(answer["attention_backends"]), block_size=answer["block_size"],
        kv_cache_dtype=answer["kv_cache_dtype"], mamba_cache_mode=answer.get("mamba_cache_mode"),
        enable_prefix_caching=bool(answer["enable_prefix_caching"]), groups=groups,
        num_blocks=answer["num_blocks"], blocks_per_request=answer["blocks_per_request"],
        max_concurrency=answer["max_concurrency"], kv_tokens=answer["kv_tokens"],
        sessions_at={int(k): v for k, v in answer.get("sessions_at", {}).items()},
        kv_layers=answer["kv_layers"], seconds=answer["seconds"], notes=tuple(answer.get("notes", ())),
        cpu_isa=answer.get("cpu_isa"),
        backend_kv_dtypes={k: tuple(v) for k, v in answer.get("backend_kv_dtypes", {}).items()})


@dataclass(frozen=True)
class Question:
    model: Path
    args: tuple[str, ...]
    contexts: tuple[int, ...] = ()


def ask_many(questions: Sequence[Question], device: Device = THIS_MACHINE, python: str | None = None,
             timeout_s: float = PROBE_TIMEOUT_S) -> list[VllmFigures | VllmRefused | EmulationGap]:
    """One interpreter answers every question (vLLM is imported once): figures, or vLLM's refusal."""
    job = {"device": device.as_request(),
           "requests": [{"model": str(q.model), "args": list(q.args), "contexts": list(q.contexts)}
                        for q in questions]}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        done = subprocess.run([engine_python(python), str(PROBE_SCRIPT)], input=json.dumps(job), text=True,
                              capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise ProbeUnavailable(f"the vLLM probe did not answer within {timeout_s:.0f} s") from None
    try:
        answers = json.loads(done.stdout)["answers"]
    except (ValueError, KeyError):
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise ProbeUnavailable(f"the vLLM probe failed (exit {done.returncode}): {tail}") from None
    out: list[VllmFigures | VllmRefused | EmulationGap] = []
    for a in answers:
        try:
            out.append(_figures(a))
        except (VllmRefused, EmulationGap) as e:
            out.append(e)
    return out


def ask(model: Path, args: Sequence[str], device: Device = THIS_MACHINE, python: str | None = None,
        contexts: Sequence[int] = ()) -> VllmFigures:
    """vLLM's figures for one command line; raises VllmRefused with vLLM's reason."""
    (answer,) = ask_many([Question(Path(model), tuple(args), tuple(contexts))], device, python)
    if isinstance(answer, (VllmRefused, EmulationGap)):
        raise answer
    return answer
