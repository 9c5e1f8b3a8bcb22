"""The golden set: its file, each case's checks and the agreement with the running model."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.ops import doctor
from appliance.upgrade import golden
from appliance.upgrade.golden import Answer, GoldenCase, GoldenSetError


def test_the_packaged_set_loads():
    cases = golden.load(None)
    assert len(cases) >= 5 and any(c.expect for c in cases)


def test_a_bad_line_is_named(tmp_path: Path):
    f = tmp_path / "g.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": "x", "expct": ["y"]}\n')
    with pytest.raises(GoldenSetError, match=r"g.jsonl:3: expct"):
        golden.load(f)
    f.write_text("# only a comment\n")
    with pytest.raises(GoldenSetError, match="no cases"):
        golden.load(f)
    with pytest.raises(GoldenSetError, match="cannot read"):
        golden.load(tmp_path / "missing.jsonl")


def test_each_check_can_fail():
    case = GoldenCase.model_validate({"prompt": "p", "expect": ["Paris"], "json": True, "max_latency_s": 1})
    assert golden.case_problems(case, Answer('{"city": "paris"}', 0.5)) == []
    problems = golden.case_problems(case, Answer("Lyon", 2.0))
    assert len(problems) == 3
    assert "lacks ['Paris']" in problems[0] and "not a JSON object" in problems[1] and "took 2.0s" in problems[2]


def test_agreement_catches_a_model_that_answers_garbage():
    cases = [GoldenCase(prompt="a"), GoldenCase(prompt="b")]
    reference = ["The capital of France is Paris.", "Bees make honey from nectar."]
    same = [Answer("The capital of France is Paris.", 1), Answer("Bees make honey from flower nectar.", 1)]
    garbage = [Answer("zx qq unrelated tokens", 1), Answer("", 1)]
    ok = golden.judge(cases, same, reference, 0.5)
    assert ok.passed and ok.agreement is not None and ok.agreement > 0.9
    bad = golden.judge(cases, garbage, reference, 0.5)
    assert not bad.passed and "agree 0.00" in bad.summary()
    assert golden.judge(cases, garbage, None, 0.5).passed  # a rollback has no reference to agree with


def test_the_doctor_shows_a_failed_upgrade_and_its_reason():
    last = {"id": "u1", "kind": "upgrade", "result": "rolled_back", "step": "gate", "reason": "golden set: bad",
            "target": "/m/new (sha256:1)", "at": 0}
    f = doctor.upgrade({"running": None, "committed": "/m/old", "previous": None, "last": last})
    assert f.status == "warn" and "rolled back at gate: golden set: bad" in f.summary and f.advice
    ok = doctor.upgrade({"running": None, "committed": "/m/new", "previous": "/m/old", "last": {**last,
                         "result": "committed", "step": "commit"}})
    assert ok.status == "ok"
    assert doctor.upgrade({"running": None, "committed": "/m/old", "previous": None, "last": None}).status == "ok"
