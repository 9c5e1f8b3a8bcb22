"""Labels from the ledger (issue 34, item 2; cascade.labels, Outbox.done): an escalation made from a judged
local answer, delivered by either path (sync, or the forwarder after a queue), leaves one label with the
local answer's signals and the two answers' agreement; texts only where the site keeps them; none for an
escalation with no judged local answer; bounded in rows and age."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from cascade.forwarder import Forwarder
from cascade.labels import agreement, answer_text
from cascade.outbox import Outbox
from cascade.policy import PolicyConfig
from cascade.regional import RegionalClient, RegionalSettings
from cascade.service import Cascade
from cascade.signals import TokenLogprobs, compute

BODY = {"model": "big", "messages": [{"role": "user", "content": "Capital of France?"}]}


def _answer(text: str) -> dict:
    return {"id": "r", "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": "stop"}]}


@pytest.mark.parametrize(("local", "regional", "agree", "field", "value"), [
    ("Paris.", "paris", True, "exact", True),
    ("Paris", "The capital of France is Paris.", True, "contained", True),
    ("B) because it floats", "(b)", True, "chosen", True),
    ("Yes, it does.", "no", False, "chosen", False),
    ('{"city": "Paris", "n": 1}', '{"n": 1, "city": "Paris"}', True, "chosen", True),
    ("Lyon", "Paris", False, "f1", 0.0),
    ("the big red balloon", "a red balloon, big", True, "f1", 1.0),
])
def test_two_answers_are_compared_as_short_answer_evaluations_compare_them(local, regional, agree, field, value):
    a = agreement(local, regional)
    assert a.agree is agree and getattr(a, field) == value, a


def _signals():
    return compute(TokenLogprobs((-2.5, -0.1, -3.0, -0.2), ()), 0.1)


def _deliver(box: Outbox, how: str, regional_text: str, judged) -> None:
    client = RegionalClient(RegionalSettings(base_url="http://regional/v1", model="big", retries=0),
                            transport=httpx.MockTransport(lambda r: httpx.Response(200, json=_answer(regional_text))))
    cascade = Cascade(PolicyConfig(regional_enabled=True, regional_model="big"), box, client, None)

    async def go() -> None:
        await cascade.escalate("/v1/chat/completions", BODY, sync=how == "sync", priority_class="silver",
                               tenant="lab", key_id=None, reason="low confidence", keep_model=True, judged=judged)
        if how == "forwarded":
            await Forwarder(box, client).step()
        await client.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("how", ["sync", "forwarded"])
def test_a_delivered_escalation_of_a_judged_answer_leaves_one_label(tmp_path: Path, how):
    box = Outbox(tmp_path / "o.db")
    _deliver(box, how, "The capital of France is Paris.", ("Paris", _signals()))
    (label,) = box.labels()
    assert (label["route"], label["tenant"], label["agree"], label["contained"]) == ("/v1/chat/completions", "lab", 1, 1)
    assert label["signals"]["quantile_logprob"] == pytest.approx(_signals().quantile_logprob)
    assert label["local_answer"] is None and label["regional_answer"] is None  # texts not kept by default
    (esc,) = box.list()
    assert esc.status == "done"
    row = box.db.execute("SELECT local_answer, local_signals FROM escalations").fetchone()
    assert row[0] is None and row[1] is not None  # the local text leaves the row once labelled
    box.done(esc.id, _answer("again"))  # a second delivery of the same escalation labels nothing twice
    assert len(box.labels()) == 1


def test_texts_are_kept_with_the_label_only_where_the_site_keeps_texts(tmp_path: Path):
    box = Outbox(tmp_path / "o.db", keep_label_text=True)
    _deliver(box, "sync", "Lyon", ("Paris", _signals()))
    (label,) = box.labels()
    assert (label["local_answer"], label["regional_answer"], label["agree"]) == ("Paris", "Lyon", 0)


def test_an_escalation_without_a_judged_answer_leaves_no_label(tmp_path: Path):
    box = Outbox(tmp_path / "o.db")
    _deliver(box, "sync", "Paris", None)  # escalated before any local answer (policy, header)
    assert box.labels() == [] and box.list()[0].status == "done"


def test_labels_are_bounded_in_rows_and_age(tmp_path: Path):
    now = [1000.0]
    box = Outbox(tmp_path / "o.db", clock=lambda: now[0], labels_max_rows=3, labels_max_age_s=100)
    for i in range(5):
        esc = box.put("/v1/chat/completions", BODY, local_answer="Paris", local_signals={"quantile_logprob": -1.0})
        now[0] += 1
        box.done(esc.id, _answer(f"answer {i}"))
    assert len(box.labels()) == 3
    now[0] += 500
    esc = box.put("/v1/chat/completions", BODY, local_answer="Paris", local_signals={"quantile_logprob": -1.0})
    box.done(esc.id, _answer("Paris"))
    assert [label["esc_id"] for label in box.labels()] == [esc.id]  # the old ones aged out


def test_an_outbox_from_before_labels_gains_the_columns(tmp_path: Path):
    import sqlite3

    path = tmp_path / "old.db"
    Outbox(path).close()
    with sqlite3.connect(path) as c:
        c.execute("DROP TABLE labels")
        c.execute("ALTER TABLE escalations DROP COLUMN local_answer")
        c.execute("ALTER TABLE escalations DROP COLUMN local_signals")
    box = Outbox(path)
    esc = box.put("/v1/chat/completions", BODY, local_answer="Paris", local_signals={"quantile_logprob": -1.0})
    box.done(esc.id, _answer("Paris"))
    assert box.labels()[0]["exact"] == 1


def test_answer_text_reads_chat_and_completions():
    assert answer_text(_answer("x")) == "x"
    assert answer_text({"choices": [{"index": 0, "text": "y"}]}) == "y"
    assert answer_text({}) == "" and answer_text(None) == ""
