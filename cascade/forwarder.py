"""The background forwarder: sends queued escalations when the link is up.

Gold before silver before bronze, oldest first, `concurrency` at a time. While the breaker is open it
waits (the breaker's wait doubles up to its cap) and probes the link; a new escalation or an operator's
retry wakes it at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from cascade.delivery import RetryPolicy, deliver
from cascade.outbox import Escalation, Outbox
from cascade.regional import RegionalClient

log = logging.getLogger(__name__)


class Forwarder:
    def __init__(self, outbox: Outbox, client: RegionalClient, *, concurrency: int = 4, poll_s: float = 2.0,
                 retry: RetryPolicy = RetryPolicy(), on_result: Callable[[str], None] = lambda outcome: None) -> None:
        self.outbox = outbox
        self.client = client
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.retry = retry
        self.on_result = on_result
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        recovered = await asyncio.to_thread(self.outbox.recover)
        if recovered:
            log.warning("outbox: %d escalations were being sent when the appliance stopped; sending them again "
                        "with their idempotency keys", recovered)
        while True:
            await asyncio.to_thread(self.outbox.expire)
            sent_any = await self.step()
            if not sent_any:
                await self._sleep(self._idle_wait())

    def _idle_wait(self) -> float:
        br = self.client.breaker
        return max(0.05, min(self.poll_s, br.retry_in_s)) if br.state == "open" else self.poll_s

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def step(self) -> bool:
        """One batch: True when something was sent successfully (so the loop goes on at once)."""
        br = self.client.breaker
        if br.state == "open" and br.retry_in_s > 0:
            return False
        limit = self.concurrency if br.state == "closed" else 1  # half-open: one probe
        batch = await asyncio.to_thread(self.outbox.claim, limit)
        if not batch:
            if self.client.link_up is False and br.allow():
                await self.client.probe()  # nothing to send: a cheap probe keeps the link state true
            return False
        results = await asyncio.gather(*(self._send(e) for e in batch))
        return any(results)

    async def _send(self, esc: Escalation) -> bool:
        # The row holds the request exactly as it goes over the link (see service.regional_body).
        sent = await deliver(self.client, self.outbox, esc.id, esc.route, esc.request, attempts=esc.attempts,
                             priority_class=esc.priority_class, tenant=esc.tenant, retry=self.retry)
        if sent.outcome == "rejected":
            log.warning("escalation %s refused by the regional cluster: %s", esc.id, sent.error,
                        extra={"ESCALATION_ID": esc.id})
        self.on_result(sent.outcome)
        return sent.outcome == "delivered"
