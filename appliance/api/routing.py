"""Where a request is answered: the cascade policy's decision, the regional answer, the judged local one.

The gateway asks `decide` once per request. A refusal's kind (not its wording) picks the status. Sync
escalations are answered here from the regional cluster, falling back to the local engine when the
link cannot deliver; under the auto policy the local answer is judged here and escalated when its
confidence signals say so.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

from fastapi.responses import Response

from appliance.api import answers
from appliance.api.dialects import take_usage
from appliance.api.errors import ApiError, retry_later
from appliance.api.exchange import Exchange
from appliance.api.relay import StreamJudge
from cascade import signals
from cascade.policy import Decision, PolicyError, RequestFacts, parse_headers
from cascade.service import Cascade, EscalationResult


class Routing:
    def __init__(self, cascade: Cascade | None, served_name: str, retry_after_s: int) -> None:
        self.cascade = cascade
        self.served_name = served_name
        self.retry_after_s = retry_after_s
        self._shadows: set[asyncio.Task] = set()  # shadow sends under way (held: a task nobody holds may be lost)

    def decide(self, headers: Mapping[str, str], model: str, prompt_tokens: int, max_tokens: int | None,
               tenant: str | None) -> Decision | None:
        """The policy's decision; None when no regional cluster is configured (everything is local)."""
        if self.cascade is None:
            return None
        try:
            header_escalate, header_mode, local_only = parse_headers(dict(headers))
        except PolicyError as e:
            raise ApiError(400, str(e), code="invalid_header", param=e.param) from None
        return self.cascade.decide(RequestFacts(
            model=model, tenant=tenant, header_escalate=header_escalate,
            header_mode=header_mode, local_only_header=local_only, prompt_tokens=prompt_tokens,
            max_tokens=max_tokens))

    def serves_regionally(self, model: str) -> bool:
        return self.cascade is not None and self.cascade.serves_regionally(model)

    @property
    def link_usable(self) -> bool:
        return self.cascade is not None and self.cascade.link_usable

    async def escalate(self, ex: Exchange, sync: bool, reason: str,
                       judged: tuple[str, signals.Signals | None] | None = None) -> EscalationResult:
        assert self.cascade is not None
        return await self.cascade.escalate(
            ex.route, ex.original, sync=sync, priority_class=ex.cls, tenant=ex.tenant, key_id=ex.rec.key_id,
            reason=reason, keep_model=ex.rec.model != self.served_name, judged=judged)

    async def answer_regionally(self, ex: Exchange, fallback_local: bool) -> Response | None:
        """Sync escalation: the regional answer when the link delivers it; else None when the local engine
        is to answer instead (fallback_local: the gateway does, marked), else 503 with the escalation's id
        when it was queued."""
        decision = ex.decision
        assert decision is not None and self.cascade is not None
        reason = decision.reason if decision.action == "escalate_now" else "the local engine is not ready"
        ex.enter("regional")
        result = await self.escalate(ex, sync=True, reason=reason)
        ex.escalation = result
        if result.outcome == "answered" and result.answer is not None:
            headers = {"X-Request-Id": ex.id, **answers.headers_for(result, reason, "regional")}
            if ex.stream:
                take_usage(ex.rec, result.answer.body.get("usage"))
                return ex.answered(200, answers.as_stream(result.answer.body, ex.client_wants_usage), headers,
                                   media_type="text/event-stream")
            return ex.answered(200, json.dumps(result.answer.body).encode(), headers)
        if fallback_local:
            self.cascade.count("fallback")
            return None
        where = f"; it is queued as {result.id} (GET /v1/escalations/{result.id})" if result.outcome == "queued" else ""
        raise retry_later(503, f"the regional cluster could not answer ({result.error or result.outcome}){where}",
                          "regional_unavailable", self.retry_after_s, answers.headers_for(result, reason, "none"))

    async def judged(self, ex: Exchange, content: bytes, headers: dict[str, str]) -> Response:
        """Auto policy, non-streamed: judge the local answer; escalate it when the signals say so."""
        assert self.cascade is not None and ex.decision is not None
        try:
            data = json.loads(content)
        except ValueError:
            return ex.answered(200, content, headers)
        computed = self.cascade.signals_of(signals.from_response(data))
        escalate, why = self.cascade.judge_signals(computed, ex.route, ex.tenant, ex.original)
        judged = (ex.dialect.text_of(data, False), computed)
        if not ex.client_wants_logprobs:
            answers.hide_logprobs(data)
        local = json.dumps(data).encode()
        if not escalate:
            headers[answers.ESCALATION] = "none"
            headers[answers.ESCALATION_REASON] = why
            self.shadow(ex, judged)
            return ex.answered(200, local, headers)
        result = await self.escalate(ex, sync=ex.decision.mode == "sync", reason=f"low confidence: {why}",
                                     judged=judged)
        if result.outcome == "answered" and result.answer is not None:
            headers.update(answers.headers_for(result, f"low confidence: {why}", "regional"))
            return ex.answered(200, json.dumps(result.answer.body).encode(), headers)
        headers.update(answers.headers_for(result, f"low confidence: {why}", "local"))
        return ex.answered(200, local, headers)

    def shadow(self, ex: Exchange, judged: tuple[str, signals.Signals | None]) -> None:
        """Maybe send this kept answer for a label only (policy.shadow_share), in a task of its own: the
        client's answer does not wait for the outbox's write."""
        assert self.cascade is not None and ex.decision is not None
        if self.cascade.shadow_share <= 0:
            return
        task = asyncio.create_task(self.cascade.shadow(
            ex.route, ex.original, priority_class=ex.cls, tenant=ex.tenant, key_id=ex.rec.key_id, judged=judged,
            may_escalate=ex.decision.may_escalate, keep_model=ex.rec.model != self.served_name))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    def stream_judge(self, ex: Exchange) -> StreamJudge:
        """Auto policy, streamed: the answer is judged when it is complete, before its [DONE]."""
        async def after(tl: signals.TokenLogprobs) -> bytes:
            assert self.cascade is not None
            computed = self.cascade.signals_of(tl)
            escalate, why = self.cascade.judge_signals(computed, ex.route, ex.tenant, ex.original)
            judged = ("".join(judge.texts), computed)
            if not escalate:
                self.shadow(ex, judged)
                return b""
            # The answer has been streamed already: the escalation is queued (async) whatever the mode.
            result = await self.escalate(ex, sync=False, reason=f"low confidence: {why}", judged=judged)
            if result.id:
                return answers.sse_comment(f"appliance-escalation-id={result.id} reason={why}")
            return answers.sse_comment(f"appliance-escalation={result.outcome} reason={why}")

        judge = StreamJudge(hide=not ex.client_wants_logprobs, after=after)
        return judge
