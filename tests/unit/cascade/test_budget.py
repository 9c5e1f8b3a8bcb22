"""The escalation budget (issue 34, item 1; cascade.budget): the threshold follows the recent distribution
of the signal so the share escalated stays at the target when the traffic shifts, per route and tenant; the
fixed threshold stands while the budget warms up; the share and threshold show in the metrics."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cascade.budget import BudgetConfig, Budgets
from cascade.outbox import Outbox
from cascade.policy import PolicyConfig, Thresholds
from cascade.service import Cascade
from cascade.signals import TokenLogprobs


def _answer(value: float) -> TokenLogprobs:
    """An answer whose quantile_logprob is `value` (every token equally sure)."""
    return TokenLogprobs((value,) * 8, ())


def _cascade(tmp_path: Path, budgets: Budgets) -> Cascade:
    cfg = PolicyConfig(regional_enabled=True, default="auto", thresholds=Thresholds(quantile_logprob=-1.6))
    return Cascade(cfg, Outbox(tmp_path / "o.db"), None, None, budgets=budgets)


def test_the_share_holds_when_the_traffic_shifts_and_the_threshold_moves(tmp_path):
    """Confident traffic, then doubtful traffic (a fixed -1.6 would escalate about 1% of the first and 99%
    of the second): the budget escalates 20% of each once its window has refilled."""
    rng = random.Random(7)
    cascade = _cascade(tmp_path, Budgets(BudgetConfig(0.2, window=500, warmup=50)))
    decided: list[bool] = []
    thresholds = []
    for mean in (-0.8, -3.0):
        for _ in range(1500):
            escalate, _ = cascade.judge(_answer(rng.gauss(mean, 0.4)))
            decided.append(escalate)
        thresholds.append(cascade.budgets.status()[0]["threshold"])
        last = decided[-500:]
        assert abs(sum(last) / len(last) - 0.2) <= 0.03, f"{sum(last) / len(last):.3f} escalated at mean {mean}"
    assert thresholds[1] < thresholds[0] - 1.5  # it followed the traffic down
    fixed = [v < -1.6 for v in (rng.gauss(-3.0, 0.4) for _ in range(500))]
    assert sum(fixed) / len(fixed) > 0.9  # what the fixed threshold would have sent over the backhaul


def test_the_fixed_threshold_stands_until_the_budget_has_warmed_up(tmp_path):
    cascade = _cascade(tmp_path, Budgets(BudgetConfig(0.2, window=100, warmup=10)))
    early = [cascade.judge(_answer(-1.0)) for _ in range(9)]
    assert all(not e and "fixed threshold" in why for e, why in early)
    assert cascade.budgets.status()[0]["warming_up"] and cascade.budgets.status()[0]["threshold"] is None
    assert cascade.judge(_answer(-2.0))[0]  # below -1.6: the fixed threshold still decides this one
    _, why = cascade.judge(_answer(-1.5))  # the eleventh: the budget's threshold (the window's 20%)
    assert "budget's threshold" in why


def test_each_route_and_tenant_keeps_its_own_budget(tmp_path):
    budgets = Budgets(BudgetConfig(0.2, window=50, warmup=5), {"lab": BudgetConfig(0.5, window=50, warmup=5)})
    cascade = _cascade(tmp_path, budgets)
    rng = random.Random(1)
    for _ in range(200):
        cascade.judge(_answer(rng.gauss(-1, 0.5)), "/v1/chat/completions", None)
        cascade.judge(_answer(rng.gauss(-1, 0.5)), "/v1/chat/completions", "lab")
        cascade.judge(_answer(rng.gauss(-4, 0.5)), "/v1/completions", None)
    held = {(b["route"], b["tenant"]): (b["target"], b["share"]) for b in budgets.status()}
    assert set(held) == {("/v1/chat/completions", None), ("/v1/chat/completions", "lab"), ("/v1/completions", None)}
    for target, share in held.values():
        assert abs(share - target) <= 0.1, held


def test_without_a_budget_the_fixed_thresholds_decide(tmp_path):
    cascade = _cascade(tmp_path, Budgets(None))
    assert cascade.judge(_answer(-2.0)) == (True, "quantile_logprob -2.000 is below -1.6")
    assert cascade.budgets.status() == []


@pytest.mark.parametrize(("share", "window", "warmup"), [(0.0, 10, 5), (1.0, 10, 5), (0.2, 10, 11)])
def test_a_budget_out_of_range_is_refused(share, window, warmup):
    with pytest.raises(ValueError):
        BudgetConfig(share, window, warmup)


def test_the_budget_is_configured_and_shown_in_the_metrics(tmp_path):
    from appliance.boot import config
    from appliance.boot.escalation import budgets
    from appliance.ops.metrics import Metrics

    cfg = config.parse(f'[model]\npath = "{tmp_path}"\n[state]\ndirectory = "{tmp_path}/s"\n'
                       '[policy]\nescalate = "auto"\nescalation_share = 0.2\nbudget_window = 40\nbudget_warmup = 10\n'
                       '[policy.tenants.lab]\nescalation_share = 0.4\n')
    b = budgets(cfg)
    assert b.config_for(None) == BudgetConfig(0.2, 40, 10) and b.config_for("lab") == BudgetConfig(0.4, 40, 10)
    cascade = _cascade(tmp_path, b)
    for i in range(20):
        cascade.judge(_answer(-0.1 * i))
    m = Metrics()
    m.attach_cascade(cascade.status)
    text = m.render().decode()
    assert 'appliance_escalation_budget_target{route="/v1/chat/completions",tenant=""} 0.2' in text
    assert 'appliance_escalation_budget_threshold{route="/v1/chat/completions",tenant=""}' in text
    assert 'appliance_escalation_budget_share{route="/v1/chat/completions",tenant=""}' in text
    with pytest.raises(config.ConfigError):
        config.parse(f'[model]\npath = "{tmp_path}"\n[policy]\nescalation_share = 1.5\n')
