"""Where a request is answered: the cascade policy's decision, the regional answer, the judged local one.

The gateway asks `decide` once per request. A refusal's kind (not its wording) picks the status. Sync
escalations are answered here from the regional cluster, falling back to the local engine when the
link cannot deliver; under the auto policy the local answer is judged here and escalated when its
confidence signals say so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import Response

from appliance.api import answers
from appliance.api.errors import ApiError, retry_later
from appliance.api.intake import Job
from appliance.api.recording import Recorder, take_usage
from appliance.api.relay import StreamJudge
from cascade import signals
from cascade.policy import Decision, PolicyError, RequestFacts, parse_headers
from cascade.service import Cascade, EscalationResult


class Routing:
    def __init__(self, cascade: Cascade | None, served_name: str, recorder: Recorder, retry_after_s: int) -> None:
        self.cascade = cascade
        self.served_name = served_name
        self.recorder = recorder
        self.retry_after_s = retry_after_s

    def decide(self, headers: Mapping[str, str], model: str, prompt_tokens: int, max_tokens: int | None,
               key: Any) -> Decision | None:
        """The policy's decision; None when no regional cluster is configured (everything is local)."""
        if self.cascade is None:
            return None
        try:
            header_escalate, header_mode, local_only = parse_headers(dict(headers))
        except PolicyError as e:
            raise ApiError(400, str(e), code="invalid_header", param=e.param) from None
        return self.cascade.decide(RequestFacts(
            model=model, tenant=key.tenant if key else None, header_escalate=header_escalate,
            header_mode=header_mode, local_only_header=local_only, prompt_tokens=prompt_tokens,
            max_tokens=max_tokens))

    def serves_regionally(self, model: str) -> bool:
        return self.cascade is not None and self.cascade.serves_regionally(model)

    @property
    def link_usable(self) -> bool:
        return self.cascade is not None and self.cascade.link_usable

    async def escalate(self, job: Job, sync: bool, reason: str) -> EscalationResult:
        assert self.cascade is not None
        return await self.cascade.escalate(
            job.rec.route, job.original, sync=sync, priority_class=job.cls, tenant=job.tenant, key_id=job.rec.key_id,
            reason=reason, keep_model=job.rec.model != self.served_name)

    async def answer_regionally(self, job: Job, fallback_local: bool) -> Response | None:
        """Sync escalation: the regional answer when the link delivers it; else None when the local engine
        is to answer instead (fallback_local: the gateway does, marked), else 503 with the escalation's id
        when it was queued."""
        rec, decision = job.rec, job.decision
        assert decision is not None and self.cascade is not None
        reason = decision.reason if decision.action == "escalate_now" else "the local engine is not ready"
        job.flight.enter("regional")
        result = await self.escalate(job, sync=True, reason=reason)
        job.escalation = result
        if result.outcome == "answered" and result.answer is not None:
            headers = {"X-Request-Id": rec.id, **answers.headers_for(result, reason, "regional")}
            rec.status = 200
            take_usage(rec, result.answer.body.get("usage"))
            self.recorder.record(rec, job.t0)
            if job.stream:
                return Response(answers.as_stream(result.answer.body, job.client_wants_usage), status_code=200,
                                media_type="text/event-stream", headers=headers)
            return Response(json.dumps(result.answer.body).encode(), status_code=200,
                            media_type="application/json", headers=headers)
        if fallback_local:
            self.cascade.count("fallback")
            return None
        where = f"; it is queued as {result.id} (GET /v1/escalations/{result.id})" if result.outcome == "queued" else ""
        raise self.recorder.failed(rec, job.t0, retry_later(
            503, f"the regional cluster could not answer ({result.error or result.outcome}){where}",
            "regional_unavailable", self.retry_after_s, answers.headers_for(result, reason, "none")))

    async def judged(self, job: Job, content: bytes, headers: dict[str, str]) -> Response:
        """Auto policy, non-streamed: judge the local answer; escalate it when the signals say so."""
        assert self.cascade is not None and job.decision is not None
        try:
            data = json.loads(content)
        except ValueError:
            return self.recorder.finish(job.rec, job.t0, 200, content, headers)
        escalate, why = self.cascade.judge(signals.from_response(data))
        if not job.client_wants_logprobs:
            answers.hide_logprobs(data)
        local = json.dumps(data).encode()
        if not escalate:
            headers[answers.ESCALATION] = "none"
            headers[answers.ESCALATION_REASON] = why
            return self.recorder.finish(job.rec, job.t0, 200, local, headers)
        result = await self.escalate(job, sync=job.decision.mode == "sync", reason=f"low confidence: {why}")
        if result.outcome == "answered" and result.answer is not None:
            headers.update(answers.headers_for(result, f"low confidence: {why}", "regional"))
            return self.recorder.finish(job.rec, job.t0, 200, json.dumps(result.answer.body).encode(), headers)
        headers.update(answers.headers_for(result, f"low confidence: {why}", "local"))
        return self.recorder.finish(job.rec, job.t0, 200, local, headers)

    def stream_judge(self, job: Job) -> StreamJudge:
        """Auto policy, streamed: the answer is judged when it is complete, before its [DONE]."""
        async def after(tl: signals.TokenLogprobs) -> bytes:
            assert self.cascade is not None
            escalate, why = self.cascade.judge(tl)
            if not escalate:
                return b""
            # The answer has been streamed already: the escalation is queued (async) whatever the mode.
            result = await self.escalate(job, sync=False, reason=f"low confidence: {why}")
            if result.id:
                return answers.sse_comment(f"appliance-escalation-id={result.id} reason={why}")
            return answers.sse_comment(f"appliance-escalation={result.outcome} reason={why}")

        return StreamJudge(hide=not job.client_wants_logprobs, after=after)
