"""The tests' regional recorder catches every way a delivery can go wrong (tests/regional.py): these are the
failures the cascade tests and bench/outbox.py rely on it to see."""

from __future__ import annotations

import pytest

from tests import loopback
from tests.regional import RegionalRecorder, marker


@pytest.fixture(scope="module")
def recorder():
    r = RegionalRecorder("http://unused")
    r.behaviour = "canned"
    yield r
    r.close()


def send(recorder: RegionalRecorder, text: str, key: str | None) -> int:
    headers = {"Idempotency-Key": key} if key else {}
    return loopback.post(f"http://127.0.0.1:{recorder.port}/v1/chat/completions", headers=headers, timeout=10,
                         json={"model": "regional", "messages": [{"role": "user", "content": text}]}).status_code


def test_each_body_once_under_its_own_key_is_clean_even_when_a_key_repeats(recorder):
    since = recorder.mark()
    a, b = marker(), marker()
    assert send(recorder, f"question {a}", "esc-a") == 200
    assert send(recorder, f"question {a}", "esc-a") == 200  # resent with the same key: the stored answer
    assert send(recorder, f"question {b}", "esc-b") == 200
    assert recorder.delivery_problems({"esc-a": a, "esc-b": b}, since) == []
    assert recorder.received["esc-a"] == 2 and recorder.applied["esc-a"] == 1


def test_a_resend_under_a_new_key_is_a_duplicate(recorder):
    since = recorder.mark()
    a = marker()
    send(recorder, f"question {a}", "esc-a1")
    send(recorder, f"question {a}", "esc-a2")  # the same escalation, applied again under another key
    problems = recorder.delivery_problems({"esc-a1": a}, since)
    assert any("applied 2 times" in p for p in problems), problems
    assert any("'esc-a2', which is no escalation id" in p for p in problems), problems


def test_missing_keyless_and_swapped_deliveries_are_each_named(recorder):
    since = recorder.mark()
    a, b, c = marker(), marker(), marker()
    send(recorder, f"question {a}", None)  # no key
    send(recorder, f"question {b}", "esc-c")  # b's body under c's id
    problems = recorder.delivery_problems({"esc-a": a, "esc-b": b, "esc-c": c}, since)
    assert any("without an Idempotency-Key" in p for p in problems), problems
    assert "esc-a: never arrived" in problems and "esc-b: never arrived" in problems
    assert "esc-c: arrived with another body than its own" in problems
    assert "esc-b: its body was applied under 'esc-c'" in problems
    assert any(p.startswith("esc-c: its body was applied 0 times") for p in problems), problems
