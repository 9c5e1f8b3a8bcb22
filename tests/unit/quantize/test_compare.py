"""quantize/compare.py's arithmetic (accuracy, agreement, loss) and the gate's place in a build. Serving
the two builds with the real engine is tests/integration/test_quantized.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantize import build, calibration, compare
from tests.unit.quantize.test_build import _source, fake_python  # noqa: F401 (a fixture)

ITEMS = [compare.EvalItem(({"role": "user", "content": "Capital of France?"},), ("Paris",)),
         compare.EvalItem(({"role": "user", "content": "2 + 3?"},), ("5", "five")),
         compare.EvalItem(({"role": "user", "content": "Say hi."},))]  # no answer: agreement only


def _run(answers: list[str]) -> compare.Run:
    return compare.Run(Path("/m"), "auto", answers, {1: 10.0}, 1 << 30)


def test_accuracy_counts_only_questions_with_answers_and_loss_is_what_b_loses():
    a = _run(["The capital of France is Paris.", "2 + 3 = 5", "Hi!"])
    b = _run(["L'Étoile de la Cité", "The answer is five.", "Hello there"])
    c = compare.Comparison(ITEMS, a, b)
    assert a.accuracy(ITEMS) == 1.0 and b.accuracy(ITEMS) == 0.5
    assert c.loss == pytest.approx(0.5) and c.agree == [False, False, False]
    assert "loss +50.0%" in c.render()


def test_without_answers_the_loss_is_the_share_that_disagrees():
    items = [compare.EvalItem(({"role": "user", "content": "q"},))] * 4
    c = compare.Comparison(items, _run(["Paris.", "yes", "blue sky", "x y z"]), _run(["paris", "Yes.", "a blue sky", "q"]))
    assert c.agree == [True, True, True, False] and c.loss == pytest.approx(0.25)


def test_an_eval_file_takes_prompts_or_messages_and_names_a_bad_line(tmp_path: Path):
    good = tmp_path / "e.jsonl"
    good.write_text('{"prompt": "2 + 2?", "answers": [4]}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    items = compare.read_eval(good)
    assert items[0].answers == ("4",) and items[0].correct("It is 4.") and not items[1].answers
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "x"}\n{"question": "y"}\n')
    with pytest.raises(compare.CompareError, match=r"b\.jsonl:2:"):
        compare.read_eval(bad)
    assert len(compare.read_eval(compare.SHIPPED_EVAL)) >= 40


def test_a_build_the_gate_refuses_is_not_placed(tmp_path: Path, fake_python: Path):  # noqa: F811
    seen = []

    def refuse(source: Path, made: Path) -> dict:
        seen.append((source.name, json.loads((made / "config.json").read_text())["quantization_config"]["format"]))
        raise build.BuildError("the build loses 20.0% ...")

    out = tmp_path / "smol"
    with pytest.raises(build.BuildError, match=r"loses 20\.0%"):
        build.quantize(_source(tmp_path), out, build.SCHEMES["w8a8-int8"], python=fake_python,
                       calibration=calibration.shipped(), log=tmp_path / "q.log", gate=refuse)
    assert seen == [("src", "int-quantized")] and not out.exists() and list(tmp_path.glob(".smol*")) == []
    passed = build.quantize(_source(tmp_path, "src2"), out, build.SCHEMES["w8a8-int8"], python=fake_python,
                            calibration=calibration.shipped(), log=tmp_path / "q.log", gate=lambda s, b: {"loss": 0.01})
    assert json.loads((out / build.BUILD_FILE).read_text())["gate"] == {"loss": 0.01} == passed.description["gate"]


def test_the_gate_refuses_past_its_bound_and_reports_what_it_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    replies = {"src": ["Paris", "5", "hi"], "good": ["Paris.", "It is 5", "hello"], "bad": ["Rome", "5", "hi"]}
    monkeypatch.setattr(compare, "run", lambda folder, items, **kw: _run(replies[folder.name]))
    check = compare.gate(ITEMS, 0.25, eval_source="the shipped set", log=tmp_path / "log")
    measured = check(Path("src"), Path("good"))
    assert measured["loss"] == 0 and measured["accuracy_build"] == 1.0 and measured["questions"] == 3
    with pytest.raises(build.BuildError, match=r"loses 50\.0% .* 100\.0% right unquantized, 50\.0% quantized"):
        check(Path("src"), Path("bad"))
