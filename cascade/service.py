"""The cascade as the gateway uses it: policy, outbox, regional client and forwarder in one place.

The request path asks `decide` before answering, `judge` after a local answer, and `escalate` to store an
escalation (always written to the outbox first) and, in sync mode, send it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from cascade import policy, signals
from cascade.budget import Budgets
from cascade.calibrator import MAX_ROWS, Calibrator
from cascade.delivery import RetryPolicy, deliver
from cascade.forwarder import Forwarder
from cascade.outbox import Escalation, Outbox, OutboxFull
from cascade.regional import RegionalAnswer, RegionalClient
from cascade.webhooks import WebhookSender

log = logging.getLogger(__name__)

Outcome = Literal["answered", "queued", "rejected", "outbox_full"]
SHADOW_REASON = "shadow: a label for a confident answer"


@dataclass(frozen=True)
class EscalationResult:
    outcome: Outcome
    escalation: Escalation | None
    answer: RegionalAnswer | None = None
    error: str = ""

    @property
    def id(self) -> str | None:
        return self.escalation.id if self.escalation else None


def prompt_chars(request: dict[str, Any]) -> int:
    """The prompt's size, as the calibrator's feature: the same measure when a label is stored and when an
    answer is judged."""
    return len(json.dumps(request.get("messages", request.get("prompt", "")), ensure_ascii=False))


def regional_body(request: dict[str, Any], regional_model: str, keep_model: bool) -> dict[str, Any]:
    """What goes over the backhaul: the client's request, non-streamed, for the regional model."""
    body = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    if regional_model and not keep_model:
        body["model"] = regional_model
    return body


class Cascade:
    def __init__(self, cfg: policy.PolicyConfig, outbox: Outbox, client: RegionalClient | None,
                 forwarder: Forwarder | None, quantile: float = signals.DEFAULT_QUANTILE,
                 retry: RetryPolicy = RetryPolicy(), budgets: Budgets | None = None,
                 calibrator: Calibrator | None = None, calibrate_every_s: float = 3600.0,
                 webhooks: WebhookSender | None = None, shadow_share: float = 0.0,
                 rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.outbox = outbox
        self.client = client
        self.forwarder = forwarder
        self.retry = retry  # the forwarder's own: one policy for every send
        self.quantile = quantile
        self.budgets = budgets or Budgets(None)  # the escalation budget per route and tenant (cascade.budget)
        # Learned from the outbox's labels (cascade.calibrator): ranks answers for the budget while it beats
        # the single signal on held-out labels. None: off.
        self.calibrator = calibrator
        self.calibrate_every_s = calibrate_every_s
        self.webhooks = webhooks  # tells a tenant's client its escalation's regional answer (cascade.webhooks)
        # Shadow sampling: this share of the answers the judge kept is also sent, for a label only (off: 0).
        self.shadow_share = shadow_share
        self._rng = rng or random.Random()
        self.counts: Counter[str] = Counter()  # local, escalated, queued, fallback, failed, refused, ...

    # -- decisions (pure, delegated) ---------------------------------------------------------------

    def decide(self, facts: policy.RequestFacts) -> policy.Decision:
        return policy.decide(self.cfg, facts)

    def signals_of(self, tl: signals.TokenLogprobs) -> signals.Signals | None:
        return signals.compute(tl, self.quantile)

    def judge(self, tl: signals.TokenLogprobs, route: str = "/v1/chat/completions",
              tenant: str | None = None, request: dict[str, Any] | None = None) -> tuple[bool, str]:
        """Escalate this local answer? And why, in words for the response's headers and the log."""
        return self.judge_signals(self.signals_of(tl), route, tenant, request)

    def judge_signals(self, s: signals.Signals | None, route: str = "/v1/chat/completions",
                      tenant: str | None = None, request: dict[str, Any] | None = None) -> tuple[bool, str]:
        """judge, for signals already computed (the gateway keeps them for the label an escalation makes).
        With an escalation budget for this route and tenant, the threshold is the budget's (cascade.budget)
        once it has warmed up; the fixed thresholds otherwise."""
        threshold, tracker = self.budgets.threshold(route, tenant)
        if tracker is None or s is None:
            return policy.judge(self.cfg.thresholds, s)
        model = self.calibrator.active if self.calibrator is not None else None
        # What the budget ranks by, lower more doubtful: the calibrator's score negated, or the signal.
        seen = {**s.as_dict(), "prompt_chars": prompt_chars(request)} if request is not None else s.as_dict()
        value, name = (-model.score(seen, route, tenant), f"calibrator v{model.version}") if model else \
            (s.quantile_logprob, "quantile_logprob")
        if threshold is None:
            escalate, why = policy.judge(self.cfg.thresholds, s)
            why = f"{why} (fixed threshold: the budget has {len(tracker.values)} of {tracker.cfg.warmup} answers)"
        else:
            escalate = value < threshold
            why = (f"{name} {value:.3f} {'is below' if escalate else 'is not below'} the budget's "
                   f"threshold {threshold:.3f} (escalating {tracker.cfg.share:.0%} of this route's answers)")
        tracker.record(value, escalate)
        return escalate, why

    async def calibrate(self) -> bool:
        """Refit the calibrator on the outbox's labels, in worker threads (a refit never holds a request);
        when the model in use changes, the budget's windows start afresh (their values were another scale)."""
        if self.calibrator is None:
            return False
        labels = await asyncio.to_thread(self.outbox.labels, MAX_ROWS)
        changed = await asyncio.to_thread(self.calibrator.refit, labels)
        if changed:
            self.budgets.reset()
        return changed

    async def run_calibration(self) -> None:
        while True:
            await asyncio.sleep(self.calibrate_every_s)
            try:
                await self.calibrate()
            except Exception:  # a bad fit is logged and the last model kept; the loop goes on
                log.exception("calibrator: the refit failed; the model in use stays")

    def serves_regionally(self, model: str) -> bool:
        return self.cfg.regional_enabled and model in self.cfg.regional_models

    @property
    def link_usable(self) -> bool:
        """Is a sync send worth trying now? False while the breaker is open (no waiting for timeouts)."""
        if self.client is None:
            return False
        br = self.client.breaker
        return br.state == "closed" or (br.state == "open" and br.retry_in_s == 0) or br.state == "half_open"

    # -- escalating --------------------------------------------------------------------------------

    async def escalate(self, route: str, request: dict[str, Any], *, sync: bool, priority_class: str,
                       tenant: str | None, key_id: str | None, reason: str, keep_model: bool = False,
                       judged: tuple[str, signals.Signals | None] | None = None) -> EscalationResult:
        """Store the escalation durably, then send it now (sync, while the link is usable) or leave it to
        the forwarder. A sync send that fails over the link leaves the row queued for the forwarder.
        `judged`: the local answer's text and signals when a judge escalated it, kept for the label its
        regional answer makes (cascade.labels)."""
        body = regional_body(request, self.cfg.regional_model, keep_model)
        local_answer, local_signals = (judged[0], dataclasses.asdict(judged[1])) if judged and judged[1] else (None, None)
        if local_signals is not None:  # a cheap request feature for the calibrator: how long the prompt was
            local_signals["prompt_chars"] = prompt_chars(request)
        try:
            esc = await asyncio.to_thread(self.outbox.put, route, body, priority_class=priority_class,
                                          tenant=tenant, key_id=key_id, reason=reason, local_answer=local_answer,
                                          local_signals=local_signals)
        except OutboxFull as e:
            self.counts["outbox_full"] += 1
            log.warning("escalation refused: %s", e)
            return EscalationResult("outbox_full", None, error=str(e))
        if not sync or self.client is None or not self.link_usable:
            self._queued(esc)
            return EscalationResult("queued", esc)
        await asyncio.to_thread(self.outbox.mark_sending, esc.id)
        sent = await deliver(self.client, self.outbox, esc.id, route, body, attempts=esc.attempts,
                             priority_class=priority_class, tenant=tenant, retry=self.retry)
        if sent.outcome == "delivered":
            self.counts["escalated"] += 1
            return EscalationResult("answered", esc, sent.answer)
        if sent.outcome in ("rejected", "gave_up"):
            self.counts["failed"] += 1
            return EscalationResult("rejected", esc, error=sent.error)
        self._queued(esc)  # link_down, retry: the forwarder sends it when the back-off is over
        return EscalationResult("queued", esc, error=sent.error)

    async def shadow(self, route: str, request: dict[str, Any], *, priority_class: str, tenant: str | None,
                     key_id: str | None, judged: tuple[str, signals.Signals | None],
                     may_escalate: bool, keep_model: bool = False) -> EscalationResult | None:
        """A confident local answer, sent with shadow_share's chance for a label only: the client keeps its
        local answer and is told nothing (no header, no webhook). Never for data that may not leave the
        site; queued like any escalation, so the budget is the share and the outbox's bound."""
        if self.shadow_share <= 0 or not may_escalate or self._rng.random() >= self.shadow_share:
            return None
        self.counts["shadow"] += 1
        return await self.escalate(route, request, sync=False, priority_class=priority_class, tenant=tenant,
                                   key_id=key_id, reason=SHADOW_REASON, keep_model=keep_model, judged=judged)

    def _queued(self, esc: Escalation) -> None:
        self.counts["queued"] += 1
        if self.forwarder is not None:
            self.forwarder.wake()

    def count(self, what: str) -> None:
        self.counts[what] += 1

    # -- observability -----------------------------------------------------------------------------

    def link_state(self) -> dict[str, Any]:
        if self.client is None:
            return {"configured": False}
        br = self.client.breaker
        return {"configured": True, "up": self.client.link_up, "breaker": br.state,
                "retry_in_s": round(br.retry_in_s, 1)}

    def status(self) -> dict[str, Any]:
        """Counts, outbox depth and age, link and breaker: for /v1/appliance/status and the metrics. No
        I/O: the outbox serves the counts its writers left (Outbox.stats)."""
        return {"configured": True, "requests": dict(self.counts), "outbox": self.outbox.stats(),
                "link": self.link_state(), "budget": self.budgets.status(),
                "calibrator": self.calibrator.status() if self.calibrator is not None else None}

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.webhooks is not None:
            await self.webhooks.aclose()
        self.outbox.close()
