"""GET / (and /status): the box's state as one HTML page, for the technician standing at it.

The same figures as /v1/appliance/status, /plan and /doctor, read by a person: rendered by the daemon
(Jinja2, autoescaped: model names, doctor advice and error codes are shown as text, never as markup),
one file with its styles inline, no JavaScript and no external assets, so it works offline and on a
site network that blocks everything. It refreshes itself every `REFRESH_S` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

REFRESH_S = 15

_env = Environment(loader=PackageLoader("appliance.ops", "templates"), autoescape=select_autoescape(["html"]),
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)


@dataclass(frozen=True)
class PageInputs:
    """What the page shows, each as its JSON route gives it."""

    status: dict[str, Any]  # /v1/appliance/status
    plan: dict[str, Any]  # /v1/appliance/plan
    doctor: dict[str, Any]  # /v1/appliance/doctor
    load: dict[str, Any]  # requests in the gateway, held for a restart, admission's in_flight and queued by class
    recent_errors: list[dict[str, Any]] = field(default_factory=list)  # request-log rows, newest first


def size(n: float | int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def weights(plan: dict[str, Any]) -> str:
    """The weights as served: their bytes and, for a quantized checkpoint, its scheme (or FP8 made by vLLM
    as it loads a 16-bit one)."""
    model = plan.get("model") or {}
    if (plan.get("weights") or {}).get("scheme") == "fp8":
        return f"{size((plan.get('memory_bytes') or {}).get('weights'))}, FP8 (quantized by vLLM at load)"
    return f"{size(model.get('weight_bytes'))}, {model.get('weight_format') or 'unquantized'}"


def render(inputs: PageInputs, *, now: float | None = None) -> str:
    now = time.time() if now is None else now
    plan = inputs.plan
    sessions = plan.get("sessions_at_context") or {}
    context = (plan.get("targets") or {}).get("context")
    return _env.get_template("status.html").render(
        st=inputs.status, plan=plan, doctor=inputs.doctor, load=inputs.load, errors=inputs.recent_errors,
        sessions=sessions.get(str(context)), context=context, kv=plan.get("kv") or {}, weights=weights(plan),
        refresh_s=REFRESH_S, now=now, size=size, age=age,
        when=lambda ts: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)))
