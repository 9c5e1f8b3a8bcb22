"""The site's traffic over time, as the doctor's grow advisor reads it: how much work was answered, how much
went to the regional tier, and how much gold work admission refused.

The counters are cumulative since the daemon started (the gateway's metrics and the cascade's counts);
`TrafficWatch` keeps a sample of them beside each engine sample, so the doctor judges a window by the
difference between its first and last sample, as it does for the engine's counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# What the cascade counts as an escalation stored for the regional tier (cascade.service): answered
# there, queued for the forwarder, refused by it, or refused because the outbox was full. "fallback" is
# not one more: it is a sync escalation that was queued and answered locally, counted under "queued".
ESCALATION_OUTCOMES = ("escalated", "queued", "failed", "outbox_full")


@dataclass(frozen=True)
class TrafficSample:
    ts: float
    answered: float = 0.0  # generation requests answered with a 200, locally or regionally
    escalations: float = 0.0
    gold_requests: float = 0.0  # generation requests of the gold class, whatever their answer
    gold_refused: float = 0.0  # gold requests admission refused (no engine slot within the class's target)


@dataclass(frozen=True)
class TrafficWindow:
    seconds: float
    answered: float
    escalations: float
    gold_requests: float
    gold_refused: float

    @classmethod
    def between(cls, samples: list[TrafficSample]) -> TrafficWindow | None:
        if len(samples) < 2:
            return None
        a, b = samples[0], samples[-1]
        return cls(seconds=b.ts - a.ts, answered=b.answered - a.answered, escalations=b.escalations - a.escalations,
                   gold_requests=b.gold_requests - a.gold_requests, gold_refused=b.gold_refused - a.gold_refused)

    @property
    def escalation_share(self) -> float | None:
        return self.escalations / self.answered if self.answered else None

    @property
    def gold_refused_share(self) -> float | None:
        return self.gold_refused / self.gold_requests if self.gold_requests else None


class TrafficWatch:
    def __init__(self, source: Callable[[float], TrafficSample], keep: int = 900) -> None:
        self.source = source
        self.samples: deque[TrafficSample] = deque(maxlen=keep)

    def record(self, ts: float) -> None:
        self.samples.append(self.source(ts))

    def since(self, seconds: float) -> list[TrafficSample]:
        cutoff = time.time() - seconds
        return [s for s in self.samples if s.ts >= cutoff]
