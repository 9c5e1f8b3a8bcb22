"""The calibrator (issue 34, item 3; cascade.calibrator): fitted on part of the site's labels and judged on
the rest, used only while it beats the single signal there; once in use the budget ranks by its score; a
refit happens in worker threads and never holds the event loop."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

from cascade.budget import BudgetConfig, Budgets
from cascade.calibrator import Calibrator, auroc, fit, fit_logistic
from cascade.outbox import Outbox
from cascade.policy import PolicyConfig, Thresholds
from cascade.service import Cascade
from cascade.signals import TokenLogprobs


def _labels(n: int, rule, seed: int = 3) -> list[dict]:
    """Labels whose disagreement follows `rule(signals, rng)`; signals drawn independently."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sig = {"mean_logprob": rng.uniform(-3, 0), "min_logprob": rng.uniform(-8, -1),
               "quantile_logprob": rng.uniform(-4, 0), "neg_mean_entropy": rng.uniform(-2, 0),
               "length": rng.randint(1, 200)}
        out.append({"signals": sig, "agree": 0 if rule(sig, rng) else 1})
    return out


def test_auroc_and_logistic_regression_against_known_answers():
    assert auroc([3, 4], [1, 2]) == 1.0 and auroc([1], [1]) == 0.5 and auroc([1, 2], [2, 3]) == 0.125
    # one feature that separates the classes: the fitted weight points the right way
    w = fit_logistic([[-1.0], [-0.5], [0.5], [1.0]] * 10, [0, 0, 1, 1] * 10)
    assert w[1] > 1.0


def test_a_calibrator_that_beats_the_single_signal_is_used():
    """Disagreement driven by the answer's length and its mean log-probability, which quantile_logprob
    does not see: the learned combination ranks the held-out answers better."""
    labels = _labels(600, lambda s, rng: s["length"] > 120 or s["mean_logprob"] < -2.4 or rng.random() < 0.05)
    model = fit(labels, 1)
    assert not isinstance(model, str)
    assert model.in_use and model.auroc_model > model.auroc_signal + 0.2, model.summary()
    assert model.held_out == 180 and model.trained == 420


def test_a_calibrator_that_loses_to_the_single_signal_is_not_used():
    """Disagreement driven by quantile_logprob alone: the single signal is as good as anything learned."""
    labels = _labels(600, lambda s, rng: s["quantile_logprob"] < -2.0)
    model = fit(labels, 1)
    assert not isinstance(model, str) and not model.in_use, model.summary()
    cal = Calibrator()
    assert cal.refit(labels) is False and cal.active is None and "not used" in cal.last


def test_too_few_or_one_sided_labels_fit_nothing():
    assert fit(_labels(50, lambda s, rng: True), 1) == "50 labels, 200 needed"
    assert "all agreements or all disagreements" in fit(_labels(300, lambda s, rng: False), 1)


def _answer(quantile: float, length: int) -> TokenLogprobs:
    return TokenLogprobs((quantile,) * length, ())


def test_in_use_the_budget_ranks_by_the_calibrator_and_starts_its_windows_afresh(tmp_path: Path):
    box = Outbox(tmp_path / "o.db")
    labels = _labels(600, lambda s, rng: s["length"] > 120 or rng.random() < 0.02)
    for lb in labels:
        esc = box.put("/v1/chat/completions", {"model": "m"}, local_answer="x", local_signals=lb["signals"])
        box.done(esc.id, {"choices": [{"index": 0, "message": {"content": "x" if lb["agree"] else "y"}}]})
    cfg = PolicyConfig(regional_enabled=True, default="auto", thresholds=Thresholds(quantile_logprob=-1.6))
    cascade = Cascade(cfg, box, None, None, budgets=Budgets(BudgetConfig(0.2, window=50, warmup=10)),
                      calibrator=Calibrator())
    for _ in range(20):
        cascade.judge(_answer(-1.0, 10))
    assert cascade.budgets.status()[0]["judged"] == 20
    assert asyncio.run(cascade.calibrate()) is True
    assert cascade.budgets.status() == []  # the windows held values of the old scale
    assert cascade.status()["calibrator"]["model"]["in_use"]
    decided = []
    for i in range(60):  # the same confident quantile throughout: only the length tells them apart
        length = 150 if i % 5 == 0 else 20
        escalate, why = cascade.judge(_answer(-0.5, length))
        decided.append((length, escalate))
    assert "calibrator v1" in why
    late = decided[20:]
    assert all(e for n, e in late if n == 150) and not any(e for n, e in late if n == 20)


def test_a_refit_never_holds_the_event_loop(tmp_path: Path):
    cascade = Cascade(PolicyConfig(regional_enabled=True), Outbox(tmp_path / "o.db"), None, None,
                      calibrator=Calibrator())
    started = threading.Event()

    def slow_refit(labels) -> bool:
        started.set()
        time.sleep(1.0)
        return False

    cascade.calibrator.refit = slow_refit  # type: ignore[method-assign, union-attr]

    async def scenario() -> float:
        refit = asyncio.create_task(cascade.calibrate())
        await asyncio.to_thread(started.wait, 5)
        worst, last = 0.0, time.monotonic()
        while not refit.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        return worst

    assert asyncio.run(scenario()) < 0.2


def test_the_doctor_shows_the_last_fit_against_the_single_signal():
    from appliance.ops.doctor import calibrator as finding

    cal = Calibrator()
    assert finding(None).status == "skip"
    assert finding(cal.status()).summary == "not fitted: not fitted yet"
    cal.refit(_labels(600, lambda s, rng: s["length"] > 120 or rng.random() < 0.05))
    shown = finding(cal.status())
    assert shown.status == "ok" and "version 1" in shown.summary and "in use" in shown.summary
    assert "against quantile_logprob's" in shown.summary


def test_the_prompt_s_length_the_route_and_the_tenant_are_features():
    """Disagreement that depends on who asks and how long the prompt was, not on the signals: the model
    learns it from those features (and the judge gives it the prompt's length the label stored)."""
    rng = random.Random(11)
    labels = []
    for _ in range(800):
        sig = {"mean_logprob": rng.uniform(-3, 0), "min_logprob": rng.uniform(-8, -1),
               "quantile_logprob": rng.uniform(-4, 0), "neg_mean_entropy": rng.uniform(-2, 0),
               "length": rng.randint(1, 200), "prompt_chars": rng.randint(10, 4000)}
        tenant, route = rng.choice(["lab", "shop"]), rng.choice(["/v1/chat/completions", "/v1/completions"])
        wrong = (tenant == "lab" and sig["prompt_chars"] > 1500) or rng.random() < 0.03
        labels.append({"signals": sig, "route": route, "tenant": tenant, "agree": 0 if wrong else 1})
    model = fit(labels, 1)
    assert not isinstance(model, str) and model.in_use, model.summary()
    assert {"log_prompt_chars", "tenant=lab", "tenant=shop", "route=/v1/completions"} <= set(model.summary()["features"])
    same = {**labels[0]["signals"], "prompt_chars": 3000}
    assert model.score(same, "/v1/chat/completions", "lab") > model.score(same, "/v1/chat/completions", "shop") + 0.3
    assert model.score(same, "/v1/chat/completions", "lab") > model.score({**same, "prompt_chars": 50},
                                                                          "/v1/chat/completions", "lab") + 0.3
