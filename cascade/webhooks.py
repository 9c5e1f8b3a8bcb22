"""Reconciliation: a client whose answer was escalated later learns the regional answer without polling
(issue 34, item 4). Per tenant, a configured URL is called once the escalation's regional answer is in,
with the answer and its agreement with the local one.

The call is owed durably: `Outbox.done` queues it in the same transaction that stores the answer, and this
sender delivers it with the outbox's guarantees: at least once, under an idempotency key (the escalation
id), with the same back-off as escalations (cascade.delivery.RetryPolicy) through a link that is down, and
never again once the receiver said 2xx. A receiver that refuses it (4xx: a wrong secret, a gone endpoint)
is not called again; the row says why.

Signed as Stripe and GitHub sign theirs, so a receiver can tell the call came from this box and was not
replayed later: `X-Appliance-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<body>" with the
tenant's secret>` (`verify` is the receiver's side, for tests and for sites that write one in Python).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from cascade.delivery import RetryPolicy
from cascade.outbox import Outbox

log = logging.getLogger(__name__)

SIGNATURE = "X-Appliance-Signature"
TOLERANCE_S = 300.0  # how old a signature a receiver accepts (`verify`)


@dataclass(frozen=True)
class Hook:
    url: str
    secret: bytes


def sign(secret: bytes, body: bytes, now: float | None = None) -> str:
    t = int(time.time() if now is None else now)
    mac = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify(secret: bytes, body: bytes, header: str, now: float | None = None, tolerance_s: float = TOLERANCE_S) -> bool:
    """The receiver's check: the signature is this body's under `secret`, made within tolerance_s."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        t = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    expected = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts.get("v1", ""))


class WebhookSender:
    def __init__(self, outbox: Outbox, hooks: dict[str | None, Hook], *, client: httpx.AsyncClient | None = None,
                 retry: RetryPolicy = RetryPolicy(), poll_s: float = 2.0, concurrency: int = 4) -> None:
        """hooks: tenant -> its webhook; None for every tenant without one of its own."""
        self.outbox, self.hooks, self.retry = outbox, hooks, retry
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0))
        self.poll_s, self.concurrency = poll_s, concurrency

    def hook_for(self, tenant: str | None) -> Hook | None:
        return self.hooks.get(tenant, self.hooks.get(None))

    async def run(self) -> None:
        recovered = await asyncio.to_thread(self.outbox.recover_webhooks)
        if recovered:
            log.warning("webhooks: %d calls were under way when the appliance stopped; calling again with "
                        "their idempotency keys", recovered)
        while True:
            if not await self.step():
                await asyncio.sleep(self.poll_s)

    async def step(self) -> bool:
        """One batch; True when something was delivered."""
        due = await asyncio.to_thread(self.outbox.claim_webhooks, self.concurrency)
        return any(await asyncio.gather(*(self._call(row) for row in due)))

    async def _call(self, row: dict[str, Any]) -> bool:
        esc_id = row["esc_id"]
        hook = self.hook_for(row["tenant"])
        if hook is None:  # the configuration dropped it since: nobody to tell
            await asyncio.to_thread(self.outbox.webhook_failed, esc_id, "no webhook configured any more", None)
            return False
        body = json.dumps(row["body"], separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": esc_id, SIGNATURE: sign(hook.secret, body)}
        try:
            r = await self.client.post(hook.url, content=body, headers=headers)
        except httpx.HTTPError as e:
            # Not reached: no attempt spent (a long outage loses nothing), the back-off by the calls tried.
            wait = self.retry.wait_s(min(row["sends"], 16), None)
            await asyncio.to_thread(self.outbox.webhook_failed, esc_id, f"{type(e).__name__}: {e}", wait, False)
            return False
        if 200 <= r.status_code < 300:
            await asyncio.to_thread(self.outbox.webhook_sent, esc_id)
            return True
        if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
            log.warning("webhook for %s refused by %s: %d", esc_id, hook.url, r.status_code,
                        extra={"ESCALATION_ID": esc_id})
            await asyncio.to_thread(self.outbox.webhook_failed, esc_id, f"refused: {r.status_code}", None)
            return False
        return await self._again(row, f"answered {r.status_code}", r.headers.get("retry-after"))

    async def _again(self, row: dict[str, Any], error: str, retry_after: str | None) -> bool:
        """The receiver answered an error it may get over (5xx, 408, 429): an attempt spent, backed off."""
        attempts = row["attempts"] + 1
        if attempts >= self.retry.max_attempts:
            await asyncio.to_thread(self.outbox.webhook_failed, row["esc_id"], f"gave up after {attempts}: {error}",
                                    None)
            return False
        wait = self.retry.wait_s(attempts, float(retry_after) if retry_after and retry_after.isdigit() else None)
        await asyncio.to_thread(self.outbox.webhook_failed, row["esc_id"], error, wait)
        return False

    async def aclose(self) -> None:
        await self.client.aclose()
