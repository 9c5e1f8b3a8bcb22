"""How an upgrade's new engine replaces the running one: beside it, or in its place.

Beside: the new engine loads while the old one serves; once it passes its gate, new requests go to it at
once and the old one finishes what it has. No request waits. It needs memory for both engines at once:
free GPU memory beside the running engine, or host memory for the CPU engine.
In place: the old engine is drained and stopped first; new requests are held (server.restart_hold_s)
while the new one loads and passes its gate. One GPU with one engine on it has no room for a second.

`auto` takes beside for a GPU engine with the room, and in place for the CPU engine: vLLM binds a CPU
engine's worker to fixed cores, where it spins while it serves, and a second engine's worker is bound to
the same cores. Measured on 2 cores: the new engine's worker ran 6 ms in 90 s beside a serving one; with
the old engine at the lowest priority it loaded, but then the old engine, finishing its answers, starved
beside the new one. Beside can still be asked for on the CPU (the running engine then yields the CPU
while the new one loads); it is for hosts with cores to spare.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import psutil

from kvbudget.gpu import Discovery
from kvbudget.plan_types import Plan

SwapMode = Literal["auto", "beside", "in_place"]

# Beyond its weights and KV pool, a CPU engine's processes (API server, engine core, worker: Python, PyTorch,
# vLLM) held about 2.1 GiB resident with the default model and a 1 GiB pool here (RSS of the three summed,
# shared libraries counted in each: 0.74 + 0.67 + 2.19 GB, less 1.34 GB of weights and pool; 2026-11-26).
CPU_ENGINE_OVERHEAD = 3 << 30
MARGIN = 1.1  # what the estimate may be short by


def engine_bytes(plan: Plan) -> int:
    """What a second engine on this plan would take: weights, draft, KV pool, the activation reserve."""
    m = plan.memory
    need = m.weights + m.draft_weights + m.kv_pool + m.reserve
    return need + CPU_ENGINE_OVERHEAD if plan.platform.kind == "cpu" else need


def room_beside(plan: Plan, discover: Callable[[], Discovery]) -> str | None:
    """None when the new engine fits beside the running one now, else why not (figures included)."""
    need = int(engine_bytes(plan) * MARGIN)
    if plan.platform.kind == "cpu":
        free = psutil.virtual_memory().available
        where = "host memory available"
    else:
        if plan.platform.gpu_count > 1:
            return "the engine spans several GPUs; a second one beside it is not planned"
        d = discover()
        if d.error or not d.gpus:
            return f"no free-memory figure from the GPU ({d.error or 'none found'})"
        free = d.gpus[0].free_bytes
        where = f"free on {d.gpus[0].name}"
    if free >= need:
        return None
    return f"a second engine needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB {where}"


def choose(asked: SwapMode, plan: Plan, discover: Callable[[], Discovery]) -> tuple[Literal["beside", "in_place"], str]:
    """The swap to make and why: `asked` (upgrade.swap, or the request's own) decides, auto by the room."""
    if asked == "in_place":
        return "in_place", "asked for in place"
    if asked == "auto" and plan.platform.kind == "cpu":
        return "in_place", "a second CPU engine's worker would spin on the same cores (upgrade.swap = \"beside\" " \
                           "asks for it all the same)"
    why_not = room_beside(plan, discover)
    if why_not is None:
        return "beside", "room for both engines" if asked == "auto" else "asked for beside; room for both engines"
    if asked == "beside":
        return "in_place", f"asked for beside, but {why_not}"
    return "in_place", why_not
