"""Sending one stored escalation over the link: the one function a sync escalation (cascade.service) and
the forwarder (cascade.forwarder) both call, so both map the same errors to the same outbox states, count
attempts the same way, back off alike and honour a Retry-After alike. The breaker is the client's own.

| the regional side                       | the row                        | outcome     |
|-----------------------------------------|--------------------------------|-------------|
| answered                                | done, with the answer          | `delivered` |
| no connection (LinkDown)                | queued again, no attempt spent | `link_down` |
| refused the request itself (4xx)        | failed                         | `rejected`  |
| failed (5xx, bad answer, a drop)        | queued after the back-off, or  | `retry`     |
|                                         | failed after max_attempts      | `gave_up`   |

The back-off doubles from `base_s` per attempt already spent, up to `max_s`, and is never shorter than
the Retry-After the cluster gave. A drop with Retry-After (llm-d's 429/503) spends no attempt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

from cascade.outbox import Outbox
from cascade.regional import LinkDown, RegionalAnswer, RegionalClient, RegionalFailed, RegionalRejected

Outcome = Literal["delivered", "link_down", "rejected", "retry", "gave_up"]


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 10  # regional.max_attempts
    base_s: float = 5.0
    max_s: float = 600.0

    def wait_s(self, attempts: int, retry_after_s: float | None) -> float:
        return max(min(self.max_s, self.base_s * 2 ** attempts), retry_after_s or 0.0)


@dataclass(frozen=True)
class Delivery:
    outcome: Outcome
    answer: RegionalAnswer | None = None
    error: str = ""


async def deliver(client: RegionalClient, outbox: Outbox, esc_id: str, route: str, body: dict[str, Any], *,
                  attempts: int, priority_class: str, tenant: str | None, retry: RetryPolicy) -> Delivery:
    """Send the row `esc_id` (already marked sending) and record what became of it in the outbox."""
    try:
        answer = await client.complete(route, body, idempotency_key=esc_id, priority_class=priority_class,
                                       tenant=tenant)
    except LinkDown as e:
        await asyncio.to_thread(outbox.release, esc_id, str(e))
        return Delivery("link_down", error=str(e))
    except RegionalRejected as e:
        await asyncio.to_thread(outbox.fail, esc_id, str(e))
        return Delivery("rejected", error=str(e))
    except RegionalFailed as e:
        status = await asyncio.to_thread(outbox.release, esc_id, str(e), retry.wait_s(attempts, e.retry_after_s),
                                         e.counts_as_attempt, retry.max_attempts)
        return Delivery("gave_up" if status == "failed" else "retry", error=str(e))
    await asyncio.to_thread(outbox.done, esc_id, answer.body)
    return Delivery("delivered", answer)
