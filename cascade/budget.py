"""An escalation budget: the threshold that keeps the share of answers escalated under `auto` at a target,
whatever the traffic asks.

A fixed threshold sets no budget: the share it escalates depends on what a site's users ask (21% to 63% by
task on the same threshold, issue 34). Here the threshold follows the recent distribution of the signal
instead: per route and tenant, the `share`-quantile of the last `window` judged answers' signal values, so
an answer is escalated when it is among the least confident `share` of what that route and tenant have
recently produced. Until `warmup` answers have been seen the fixed threshold stands (there is no
distribution to read yet), and the status says which one is in force.

Pure bookkeeping in memory, O(window) per judgement at most (one sort of a few hundred floats), off any
I/O: judging happens where the answer is complete, and this adds no wait to it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

DEFAULT_WINDOW = 500
DEFAULT_WARMUP = 50


@dataclass(frozen=True)
class BudgetConfig:
    share: float  # of judged answers to escalate, 0 < share < 1
    window: int = DEFAULT_WINDOW  # judged answers the quantile is read over, per route and tenant
    warmup: int = DEFAULT_WARMUP  # judged answers before the budget's threshold replaces the fixed one

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:
            raise ValueError(f"escalation_share must be between 0 and 1 (got {self.share})")
        if not 1 <= self.warmup <= self.window:
            raise ValueError(f"budget warm-up {self.warmup} must be from 1 to the window {self.window}")


@dataclass
class Tracker:
    """One route and tenant: the recent signal values and what was decided for each."""

    cfg: BudgetConfig
    values: deque[float] = field(default_factory=deque)
    escalated: deque[bool] = field(default_factory=deque)

    def threshold(self) -> float | None:
        """The share-quantile of the window's values, or None during warm-up."""
        if len(self.values) < self.cfg.warmup:
            return None
        ordered = sorted(self.values)
        # Escalating values strictly below the k-th smallest escalates k of n: k = share * n, rounded.
        k = max(0, min(len(ordered) - 1, math.floor(self.cfg.share * len(ordered) + 0.5)))
        return ordered[k]

    def record(self, value: float, escalated: bool) -> None:
        self.values.append(value)
        self.escalated.append(escalated)
        while len(self.values) > self.cfg.window:
            self.values.popleft()
            self.escalated.popleft()

    @property
    def share_held(self) -> float | None:
        return sum(self.escalated) / len(self.escalated) if self.escalated else None


class Budgets:
    """The trackers by (route, tenant), each with its tenant's share (else the default's)."""

    def __init__(self, default: BudgetConfig | None, tenants: dict[str, BudgetConfig] | None = None) -> None:
        self.default = default
        self.tenants = tenants or {}
        self._trackers: dict[tuple[str, str], Tracker] = {}

    def config_for(self, tenant: str | None) -> BudgetConfig | None:
        return self.tenants.get(tenant or "", self.default)

    def threshold(self, route: str, tenant: str | None) -> tuple[float | None, Tracker | None]:
        """The budget's threshold in force for this route and tenant (None: no budget, or warming up)."""
        cfg = self.config_for(tenant)
        if cfg is None:
            return None, None
        key = (route, tenant or "")
        tracker = self._trackers.get(key)
        if tracker is None:
            tracker = self._trackers[key] = Tracker(cfg)
        return tracker.threshold(), tracker

    def reset(self) -> None:
        """Every window starts afresh (what the budget ranks by has changed scale)."""
        self._trackers.clear()

    def status(self) -> list[dict[str, Any]]:
        return [{"route": route, "tenant": tenant or None, "target": t.cfg.share, "share": t.share_held,
                 "threshold": t.threshold(), "judged": len(t.values), "warming_up": t.threshold() is None}
                for (route, tenant), t in sorted(self._trackers.items())]
