"""Reconciliation by webhook (issue 34, item 4; cascade.webhooks): once an escalation's regional answer is
in, its tenant's webhook is owed a call in the same transaction; the call is signed, carries the answer and
its agreement with the local one under the escalation's idempotency key, gets through a link cut once and
only once, and a receiver that refuses it (a wrong secret) is not called again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from cascade.outbox import Outbox
from cascade.webhooks import SIGNATURE, Hook, WebhookSender, sign, verify

SECRET = b"s3cret-of-the-lab"
ANSWER = {"id": "r", "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"}}]}


class Receiver:
    """The client's endpoint: checks the signature with its secret, counts what it accepted."""

    def __init__(self, secret: bytes, down_for: int = 0) -> None:
        self.secret, self.down_for = secret, down_for
        self.accepted: list[dict] = []
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls <= self.down_for:
            raise httpx.ConnectError("link cut", request=request)
        if not verify(self.secret, request.content, request.headers.get(SIGNATURE, "")):
            return httpx.Response(401, json={"error": "bad signature"})
        body = json.loads(request.content)
        assert request.headers["idempotency-key"] == body["id"]
        self.accepted.append(body)
        return httpx.Response(204)


def _escalated(box: Outbox, tenant: str | None = "lab") -> str:
    esc = box.put("/v1/chat/completions", {"model": "m"}, tenant=tenant, local_answer="Paris",
                  local_signals={"quantile_logprob": -2.0})
    box.done(esc.id, ANSWER)
    return esc.id


def _sender(box: Outbox, receiver: Receiver, hooks: dict | None = None) -> WebhookSender:
    return WebhookSender(box, hooks or {"lab": Hook("https://client.example/hook", SECRET)},
                         client=httpx.AsyncClient(transport=httpx.MockTransport(receiver)))


def _rows(box: Outbox) -> list[tuple]:
    return box.db.execute("SELECT esc_id, status, attempts, sends FROM webhooks").fetchall()


def test_a_signed_call_carries_the_answer_and_its_agreement(tmp_path: Path):
    box = Outbox(tmp_path / "o.db", webhook_tenants=["lab"])
    esc_id = _escalated(box)
    receiver = Receiver(SECRET)
    assert asyncio.run(_sender(box, receiver).step()) is True
    (body,) = receiver.accepted
    assert body["id"] == esc_id and body["answer"] == ANSWER and body["agreement"]["exact"] is True
    assert _rows(box) == [(esc_id, "done", 0, 1)]


def test_through_a_link_cut_the_call_arrives_once_and_spends_no_attempt(tmp_path: Path):
    now = [1000.0]
    box = Outbox(tmp_path / "o.db", clock=lambda: now[0], webhook_tenants=["lab"])
    esc_id = _escalated(box)
    receiver = Receiver(SECRET, down_for=3)
    sender = _sender(box, receiver)

    async def drive() -> None:
        for _ in range(12):
            await sender.step()
            now[0] += 3600  # past any back-off

    asyncio.run(drive())
    assert len(receiver.accepted) == 1 and receiver.calls == 4
    ((_, status, attempts, sends),) = _rows(box)
    assert (status, attempts, sends) == ("done", 0, 4)
    assert box.db.execute("SELECT next_attempt FROM webhooks WHERE esc_id=?", [esc_id]).fetchone()[0] > 1000.0


def test_a_receiver_with_another_secret_refuses_and_is_not_called_again(tmp_path: Path):
    now = [1000.0]
    box = Outbox(tmp_path / "o.db", clock=lambda: now[0], webhook_tenants=["lab"])
    _escalated(box)
    receiver = Receiver(b"not the lab's secret")
    sender = _sender(box, receiver)

    async def drive() -> None:
        for _ in range(3):
            await sender.step()
            now[0] += 3600

    asyncio.run(drive())
    assert receiver.calls == 1 and receiver.accepted == []
    ((_, status, _, _),) = _rows(box)
    assert status == "failed"
    assert "refused: 401" in box.db.execute("SELECT last_error FROM webhooks").fetchone()[0]


def test_only_tenants_with_a_webhook_are_owed_a_call_and_the_default_covers_the_rest(tmp_path: Path):
    box = Outbox(tmp_path / "o.db", webhook_tenants=["lab"])
    _escalated(box, tenant="shop")
    assert _rows(box) == []
    both = Outbox(tmp_path / "p.db", webhook_tenants=["lab", None])
    shop = _escalated(both, tenant="shop")
    receiver = Receiver(b"the default's")
    hooks = {"lab": Hook("https://lab.example/", SECRET), None: Hook("https://all.example/", b"the default's")}
    assert asyncio.run(_sender(both, receiver, hooks).step()) is True
    assert receiver.accepted[0]["id"] == shop


@pytest.mark.parametrize(("age", "ok"), [(0, True), (299, True), (301, False)])
def test_signatures_expire_and_name_their_body(age, ok):
    body = b'{"id":"esc-1"}'
    header = sign(SECRET, body, now=1000.0)
    assert verify(SECRET, body, header, now=1000.0 + age) is ok
    assert not verify(SECRET, body + b" ", header, now=1000.0)
    assert not verify(SECRET, body, "garbage", now=1000.0)


def test_the_escalation_route_shows_the_agreement(tmp_path: Path):
    from cascade.policy import PolicyConfig
    from cascade.service import Cascade
    from tests.unit.appliance.api.inprocess import call, gateway

    box = Outbox(tmp_path / "o.db")
    made = gateway(tmp_path, required=False, cascade=Cascade(PolicyConfig(regional_enabled=True), box, None, None))
    try:
        esc_id = _escalated(box)
        shown = call(made.app, "GET", f"/v1/escalations/{esc_id}").json()
    finally:
        made.log.close()
    assert shown["answer"] == ANSWER and shown["agreement"]["agree"] is True and shown["agreement"]["exact"] is True
