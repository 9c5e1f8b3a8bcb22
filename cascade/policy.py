"""When a request goes over the backhaul: pure decisions from configuration, the caller and the answer.

Precedence, strongest first (the first rule that applies decides):

1. Data that must not leave the site never goes over the backhaul: a tenant marked `local_only`, or the
   request header `X-Appliance-Data: local-only`. Nothing else can override this; a request that could
   only be answered regionally is then refused.
2. No regional endpoint configured: everything is answered locally.
3. A tenant whose policy is `escalate = "never"` is never escalated (a hard limit: backhaul cost).
4. The request header `X-Appliance-Escalate: never|auto|always`, else the tenant's setting, else the
   configuration default.
5. Before answering: a model only the regional cluster serves, or a prompt that cannot fit the local
   context, is escalated at once (unless the setting is "never").
6. "always" escalates at once; "auto" answers locally and escalates when a configured confidence signal
   falls below its threshold (see `judge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from cascade.signals import Signals

Escalate = Literal["never", "auto", "always"]
ESCALATE: tuple[Escalate, ...] = get_args(Escalate)
Mode = Literal["sync", "async"]
MODES: tuple[Mode, ...] = get_args(Mode)
# The site's priority classes, highest first: admission serves, and the outbox forwards, in this order.
PriorityClass = Literal["gold", "silver", "bronze"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = get_args(PriorityClass)
Action = Literal["local", "escalate_now", "local_then_judge", "refuse"]
# Why a request for a regional-only model is refused: no regional endpoint exists (the model is not
# found here), or one exists and this request may not use it.
Refusal = Literal["no_regional_endpoint", "escalation_forbidden"]

ESCALATE_HEADER = "x-appliance-escalate"
DATA_HEADER = "x-appliance-data"
MODE_HEADER = "x-appliance-escalation-mode"


class PolicyError(ValueError):
    """A bad header value: answered 400 with the header named as `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Thresholds:
    """Escalate when a configured signal is below its threshold (None: signal not used)."""

    mean_logprob: float | None = None
    min_logprob: float | None = None
    quantile_logprob: float | None = None
    neg_mean_entropy: float | None = None


@dataclass(frozen=True)
class TenantPolicy:
    escalate: Escalate | None = None
    mode: Mode | None = None
    local_only: bool = False


@dataclass(frozen=True)
class PolicyConfig:
    regional_enabled: bool
    default: Escalate = "never"
    mode: Mode = "async"
    thresholds: Thresholds = Thresholds()
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    local_model: str = ""
    regional_model: str = ""  # what escalations of the local model ask the regional cluster for
    regional_models: frozenset[str] = frozenset()  # models clients may name that only the regional side serves
    local_context: int = 0


@dataclass(frozen=True)
class RequestFacts:
    model: str
    tenant: str | None = None
    header_escalate: Escalate | None = None
    header_mode: Mode | None = None
    local_only_header: bool = False
    prompt_tokens: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    mode: Mode
    reason: str
    may_escalate: bool  # False: this request must never be sent over the backhaul
    refusal: Refusal | None = None  # set when action is "refuse"


def parse_headers(headers: dict[str, str]) -> tuple[Escalate | None, Mode | None, bool]:
    """The policy headers, validated (case-insensitive names and values)."""
    lower = {k.lower(): v.strip().lower() for k, v in headers.items()}
    escalate = lower.get(ESCALATE_HEADER)
    if escalate is not None and escalate not in ESCALATE:
        raise PolicyError(f"X-Appliance-Escalate must be never, auto or always (got {escalate!r})", "X-Appliance-Escalate")
    mode = lower.get(MODE_HEADER)
    if mode is not None and mode not in MODES:
        raise PolicyError(f"X-Appliance-Escalation-Mode must be sync or async (got {mode!r})",
                          "X-Appliance-Escalation-Mode")
    data = lower.get(DATA_HEADER)
    if data is not None and data not in ("local-only", "any"):
        raise PolicyError(f"X-Appliance-Data must be local-only or any (got {data!r})", "X-Appliance-Data")
    return escalate, mode, data == "local-only"


def decide(cfg: PolicyConfig, req: RequestFacts) -> Decision:
    tenant = cfg.tenants.get(req.tenant or "", TenantPolicy())
    mode: Mode = req.header_mode or tenant.mode or cfg.mode
    regional_only = bool(req.model) and req.model != cfg.local_model and req.model in cfg.regional_models
    too_long = bool(cfg.local_context and req.prompt_tokens is not None
                    and req.prompt_tokens + (req.max_tokens or 0) > cfg.local_context)

    if tenant.local_only or req.local_only_header:
        why = "tenant data is local-only" if tenant.local_only else "X-Appliance-Data: local-only"
        if regional_only:
            return Decision("refuse", mode, f"model {req.model} is served only regionally and {why}", False,
                            "escalation_forbidden")
        return Decision("local", mode, why, False)
    if not cfg.regional_enabled:
        if regional_only:
            return Decision("refuse", mode, f"model {req.model} is served only regionally and no regional "
                                            "endpoint is configured", False, "no_regional_endpoint")
        return Decision("local", mode, "no regional endpoint configured", False)
    if tenant.escalate == "never":
        if regional_only:
            return Decision("refuse", mode, f"model {req.model} is served only regionally and tenant "
                                            f"{req.tenant} may not escalate", False, "escalation_forbidden")
        return Decision("local", mode, f"tenant {req.tenant} may not escalate", False)

    setting: Escalate = req.header_escalate or tenant.escalate or cfg.default
    if setting == "never":
        if regional_only:
            return Decision("refuse", mode, f"model {req.model} is served only regionally and escalation is off",
                            False, "escalation_forbidden")
        return Decision("local", mode, "escalation is off for this request", False)
    if regional_only:
        return Decision("escalate_now", mode, f"model {req.model} is served only regionally", True)
    if too_long:
        return Decision("escalate_now", mode,
                        f"prompt ({req.prompt_tokens} tokens) plus max_tokens exceeds the local context "
                        f"({cfg.local_context})", True)
    if setting == "always":
        return Decision("escalate_now", mode, "escalation is always on for this request", True)
    return Decision("local_then_judge", mode, "answer locally; escalate on low confidence", True)


def judge(thresholds: Thresholds, signals: Signals | None) -> tuple[bool, str]:
    """After a local answer under "auto": escalate when any configured signal is below its threshold."""
    if signals is None:
        return True, "the local answer is empty"
    for name in ("quantile_logprob", "min_logprob", "mean_logprob", "neg_mean_entropy"):
        limit = getattr(thresholds, name)
        value = getattr(signals, name)
        if limit is not None and value is not None and value < limit:
            return True, f"{name} {value:.3f} is below {limit:g}"
    return False, "confident enough"
