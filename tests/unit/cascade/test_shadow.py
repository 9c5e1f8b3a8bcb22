"""Shadow sampling (issue 34, item 2): a share of the answers the judge kept is also sent for a label only:
the client keeps its answer and hears nothing of it (no header, no webhook), local-only data never goes,
and it is off by default."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from cascade.outbox import Outbox
from cascade.policy import PolicyConfig, Thresholds
from cascade.service import SHADOW_REASON, Cascade
from cascade.signals import TokenLogprobs, compute
from tests.unit.appliance.api.inprocess import serving

JUDGED = ("Paris", compute(TokenLogprobs((-0.1,) * 4, ()), 0.1))


def _cascade(box: Outbox, share: float, seed: int = 0) -> Cascade:
    return Cascade(PolicyConfig(regional_enabled=True, default="auto", thresholds=Thresholds(quantile_logprob=-1.6)),
                   box, None, None, shadow_share=share, rng=random.Random(seed))


def _shadow(cascade: Cascade, may_escalate: bool = True):
    return asyncio.run(cascade.shadow("/v1/chat/completions", {"model": "m"}, priority_class="silver", tenant="lab",
                                      key_id=None, judged=JUDGED, may_escalate=may_escalate))


def test_a_shadow_send_is_labelled_and_tells_the_client_nothing(tmp_path: Path):
    box = Outbox(tmp_path / "o.db", webhook_tenants=["lab", None])
    result = _shadow(_cascade(box, 0.999))
    assert result is not None and result.outcome == "queued"
    (esc,) = box.list()
    assert esc.reason == SHADOW_REASON
    box.done(esc.id, {"choices": [{"index": 0, "message": {"content": "Paris"}}]})
    assert box.labels()[0]["agree"] == 1  # a label, like any judged escalation's
    assert box.db.execute("SELECT count(*) FROM webhooks").fetchone()[0] == 0  # and no call to the client


def test_off_by_default_never_for_local_only_data_and_the_share_is_kept(tmp_path: Path):
    box = Outbox(tmp_path / "o.db")
    assert _shadow(_cascade(box, 0.0)) is None
    assert _shadow(_cascade(box, 0.999), may_escalate=False) is None
    assert box.list() == []
    cascade = _cascade(box, 0.1, seed=5)
    sent = sum(_shadow(cascade) is not None for _ in range(400))
    assert 25 <= sent <= 60 and cascade.counts["shadow"] == sent


def test_through_the_gateway_a_kept_answer_is_shadowed_after_the_client_has_it(tmp_path: Path):
    confident = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Paris"}, "logprobs": {"content": [
            {"token": "Paris", "logprob": -0.01, "top_logprobs": [{"token": "Paris", "logprob": -0.01}]}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    box = Outbox(tmp_path / "o.db")
    made = serving(tmp_path, lambda r: httpx.Response(200, json=confident), cascade=_cascade(box, 0.999))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=made.app), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "?"}]})
            for _ in range(100):  # the shadow send is a task of its own
                if box.list():
                    break
                await asyncio.sleep(0.02)
            return r

    try:
        r = asyncio.run(go())
    finally:
        made.log.close()
    assert r.status_code == 200 and r.headers["x-appliance-escalation"] == "none"
    assert json.loads(r.content)["choices"][0]["message"]["content"] == "Paris"
    (esc,) = box.list()
    assert esc.reason == SHADOW_REASON and esc.status == "queued"
    assert time.time() - esc.created < 60
