"""One delivery function (cascade/delivery.py): a sync escalation and a forwarded one, sent to the same
regional behaviour, leave the same row (status, attempts spent, when it is due again, the error kept) and
report the same outcome; the back-off, max_attempts and Retry-After apply to both."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from cascade.delivery import RetryPolicy
from cascade.forwarder import Forwarder
from cascade.outbox import Outbox
from cascade.policy import PolicyConfig
from cascade.regional import RegionalClient, RegionalSettings
from cascade.service import Cascade

BODY = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
OK = {"id": "r1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"}]}
BEHAVIOURS = {
    "answers": lambda r: httpx.Response(200, json=OK),
    "refuses": lambda r: httpx.Response(400, json={"error": {"message": "bad request"}}),
    "fails": lambda r: httpx.Response(500, json={"error": {"message": "boom"}}),
    "drops with retry-after": lambda r: httpx.Response(503, headers={"x-llm-d-request-dropped-reason": "saturated",
                                                                    "retry-after": "90"}),
    "cannot be reached": lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused", request=r)),
}


def _row_after(tmp_path: Path, how: str, answer, retry: RetryPolicy) -> tuple[str, tuple]:
    now = [1000.0]
    box = Outbox(tmp_path / f"{how}.db", clock=lambda: now[0])
    client = RegionalClient(RegionalSettings(base_url="http://regional/v1", model="big", retries=0),
                            transport=httpx.MockTransport(answer))
    outcome = ""

    async def sync() -> None:
        nonlocal outcome
        cascade = Cascade(PolicyConfig(regional_enabled=True, regional_model="big"), box, client, None, retry=retry)
        done = await cascade.escalate("/v1/chat/completions", BODY, sync=True, priority_class="silver",
                                      tenant=None, key_id=None, reason="test", keep_model=True)
        outcome = done.outcome

    async def forwarded() -> None:
        nonlocal outcome
        seen: list[str] = []
        fwd = Forwarder(box, client, retry=retry, on_result=seen.append)
        await fwd.step()
        outcome = seen[0]

    if how == "forwarded":
        box.put("/v1/chat/completions", BODY)
    asyncio.run(sync() if how == "sync" else forwarded())
    asyncio.run(client.aclose())
    (row,) = box.list()
    return outcome, (row.status, row.attempts, row.next_attempt - now[0], row.last_error or "")


OUTCOME_OF_SYNC = {"answered": "delivered", "rejected": "rejected", "queued": "queued"}


@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
def test_sync_and_forwarded_sends_leave_the_same_row(tmp_path: Path, behaviour: str):
    retry = RetryPolicy(max_attempts=3, base_s=5, max_s=600)
    sync_outcome, sync_row = _row_after(tmp_path, "sync", BEHAVIOURS[behaviour], retry)
    fwd_outcome, fwd_row = _row_after(tmp_path, "forwarded", BEHAVIOURS[behaviour], retry)
    assert sync_row == fwd_row, (sync_row, fwd_row)
    expected = {"answers": ("answered", "delivered"), "refuses": ("rejected", "rejected"),
                "fails": ("queued", "retry"), "drops with retry-after": ("queued", "retry"),
                "cannot be reached": ("queued", "link_down")}[behaviour]
    assert (sync_outcome, fwd_outcome) == expected
    status, attempts, due_in, _ = sync_row
    if behaviour == "fails":  # the back-off, for a sync send too: 5 s after the first attempt
        assert (status, attempts, due_in) == ("queued", 1, 5.0)
    if behaviour == "drops with retry-after":  # as long as asked, no attempt spent
        assert (status, attempts) == ("queued", 0) and due_in >= 90


def test_a_sync_send_respects_max_attempts_as_the_forwarder_does(tmp_path: Path):
    retry = RetryPolicy(max_attempts=1, base_s=5)
    assert _row_after(tmp_path, "sync", BEHAVIOURS["fails"], retry)[1][0] == "failed"
    assert _row_after(tmp_path, "forwarded", BEHAVIOURS["fails"], retry)[1][0] == "failed"


def test_the_back_off_doubles_per_attempt_up_to_its_cap_and_never_undercuts_retry_after():
    retry = RetryPolicy(base_s=5, max_s=60)
    assert [retry.wait_s(n, None) for n in range(6)] == [5, 10, 20, 40, 60, 60]
    assert retry.wait_s(0, 90) == 90 and retry.wait_s(3, 10) == 40
