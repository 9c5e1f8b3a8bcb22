"""What an escalation tells a regional llm-d inference gateway about itself, and what such a gateway
answers when it will not take one.

An llm-d gateway (the Gateway API Inference Extension's endpoint picker) schedules by request headers:
the InferenceObjective the request belongs to (its priority), a fairness id (whose share it is drawn
from), and the request's latency targets. An escalation carries them from the appliance's own terms: its
priority class names the objective, the site and tenant make the fairness id, the class's targets become
the SLO headers. A gateway that drops a request under load answers 429 or 503 with a reason header and,
usually, Retry-After. Pure: no I/O.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
DROP_REASON_HEADER = "x-llm-d-request-dropped-reason"

FAIRNESS_FIELDS = ("site", "tenant")
NO_TENANT = "default"


def _token(value: str) -> str:
    """A header-safe form of a configured name: unreserved characters kept, the rest percent-encoded (so a
    non-ASCII site name still goes, and two names never collide)."""
    return quote(value, safe="-._~:/@")


def check_fairness_template(template: str) -> None:
    """ValueError unless `template` uses only {site} and {tenant}."""
    try:
        template.format(**dict.fromkeys(FAIRNESS_FIELDS, "x"))
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"fairness_id {template!r} may use only {{site}} and {{tenant}} ({e})") from None


@dataclass(frozen=True)
class GatewayHeaders:
    objectives: Mapping[str, str]  # priority class -> InferenceObjective name
    fairness_id: str = "{site}/{tenant}"
    site: str = ""
    ttft_ms: Mapping[str, int] = field(default_factory=dict)  # priority class -> x-slo-ttft-ms
    tpot_ms: Mapping[str, int] = field(default_factory=dict)  # priority class -> x-slo-tpot-ms

    def for_request(self, priority_class: str, tenant: str | None) -> dict[str, str]:
        headers = {}
        objective = self.objectives.get(priority_class)
        if objective:
            headers[OBJECTIVE_HEADER] = _token(objective)
        headers[FAIRNESS_HEADER] = _token(self.fairness_id.format(site=self.site or "appliance",
                                                                  tenant=tenant or NO_TENANT))
        if priority_class in self.ttft_ms:
            headers[TTFT_HEADER] = str(self.ttft_ms[priority_class])
        if priority_class in self.tpot_ms:
            headers[TPOT_HEADER] = str(self.tpot_ms[priority_class])
        return headers


@dataclass(frozen=True)
class Refusal:
    """A 429 or 503 from the regional gateway: why (its drop-reason header) and when to come back."""
    status: int
    reason: str | None
    retry_after_s: float | None

    def describe(self) -> str:
        why = f", reason {self.reason!r}" if self.reason else ""
        when = f"; retry after {self.retry_after_s:g}s" if self.retry_after_s is not None else ""
        return f"the regional gateway refused it for now ({self.status}{why}){when}"


def retry_after_s(value: str | None, now: float | None = None, cap_s: float = 3600.0) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110); None when absent or
    unreadable, capped so a wrong clock or a hostile value cannot park the queue for days."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return min(cap_s, float(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return min(cap_s, max(0.0, when.timestamp() - (time.time() if now is None else now)))


def refusal(status: int, headers: Mapping[str, str], cap_s: float = 3600.0) -> Refusal | None:
    """The gateway's refusal when `status` is one (429, 503), else None."""
    if status not in (429, 503):
        return None
    return Refusal(status, headers.get(DROP_REASON_HEADER) or None,
                   retry_after_s(headers.get("retry-after"), cap_s=cap_s))
