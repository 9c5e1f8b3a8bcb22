"""The cascade's pure core: confidence signals and the escalation policy."""

from __future__ import annotations

import math

import pytest

from cascade.policy import (
    Decision,
    PolicyConfig,
    PolicyError,
    RequestFacts,
    TenantPolicy,
    Thresholds,
    decide,
    judge,
    parse_headers,
)
from cascade.signals import (
    Signals,
    StreamAccumulator,
    TokenLogprobs,
    compute,
    from_response,
    quantile_logprob,
    topk_entropy,
)

# -- signals ------------------------------------------------------------------------------------------


def test_each_signal_by_hand():
    lps = (-0.1, -0.2, -3.0, -0.05, -0.4)
    tops = ((-0.1, -2.4), (-0.2, -1.7), (-1.0, -1.0), (), (-0.4, -1.1))
    s = compute(TokenLogprobs(lps, tops))
    assert s.mean_logprob == pytest.approx(sum(lps) / 5)
    assert s.min_logprob == -3.0
    # 10th percentile of [-3.0, -0.4, -0.2, -0.1, -0.05]: position 0.4 between -3.0 and -0.4
    assert s.quantile_logprob == pytest.approx(-3.0 + 0.4 * (-0.4 - -3.0))
    assert s.length == 5
    # two equally likely alternatives carry ln 2 nats; steps without top-k are skipped
    assert topk_entropy((-1.0, -1.0)) == pytest.approx(math.log(2))
    expected = -(topk_entropy(tops[0]) + topk_entropy(tops[1]) + math.log(2) + topk_entropy(tops[4])) / 4
    assert s.neg_mean_entropy == pytest.approx(expected)


def test_quantile_beats_mean_on_a_long_answer_with_one_guess():
    # Length bias: many easy tokens hide one guessed fact from the mean, not from a low quantile.
    confident_short = compute(TokenLogprobs((-0.3,) * 5, ()))
    long_with_guess = compute(TokenLogprobs((-0.01,) * 30 + (-1.0,) * 5, ()))
    assert long_with_guess.mean_logprob == pytest.approx((30 * -0.01 + 5 * -1.0) / 35)  # -0.151: looks sure
    assert long_with_guess.mean_logprob > confident_short.mean_logprob
    assert long_with_guess.quantile_logprob == -1.0  # the 10th percentile lands on the guessed tokens
    assert long_with_guess.quantile_logprob < confident_short.quantile_logprob


def test_empty_answer_has_no_signals_and_is_escalated():
    assert compute(TokenLogprobs((), ())) is None
    assert judge(Thresholds(quantile_logprob=-2), None) == (True, "the local answer is empty")


def test_quantile_bounds():
    assert quantile_logprob([-1.0, -2.0], 0) == -2.0 and quantile_logprob([-1.0, -2.0], 1) == -1.0
    with pytest.raises(ValueError):
        quantile_logprob([-1.0], 1.5)


def test_extraction_from_chat_completion_and_streams():
    chat = {"object": "chat.completion", "choices": [{"logprobs": {"content": [
        {"token": "Paris", "logprob": -0.2, "top_logprobs": [{"token": "Paris", "logprob": -0.2},
                                                             {"token": "Lyon", "logprob": -2.0}]},
        {"token": ".", "logprob": float("-inf"), "top_logprobs": []}]}}]}
    tl = from_response(chat)
    assert tl.logprobs == (-0.2, -1e9) and tl.top[0] == (-0.2, -2.0)
    completion = {"object": "text_completion", "choices": [{"logprobs": {
        "token_logprobs": [-0.5, -1.5], "top_logprobs": [{" a": -0.5, " b": -1.0}, {" c": -1.5}]}}]}
    assert from_response(completion) == TokenLogprobs((-0.5, -1.5), ((-0.5, -1.0), (-1.5,)))
    acc = StreamAccumulator()
    for item in chat["choices"][0]["logprobs"]["content"]:
        acc.add_chunk({"choices": [{"index": 0, "logprobs": {"content": [item]}}]})
    acc.add_chunk({"choices": [], "usage": {"completion_tokens": 2}})
    assert acc.result() == tl


# -- policy --------------------------------------------------------------------------------------------

CFG = PolicyConfig(
    regional_enabled=True, default="auto", mode="async",
    thresholds=Thresholds(quantile_logprob=-2.0),
    tenants={"clinic": TenantPolicy(local_only=True), "kiosk": TenantPolicy(escalate="never"),
             "research": TenantPolicy(escalate="always", mode="sync")},
    local_model="smol", regional_models=frozenset({"qwen3.6-27b"}), local_context=2048,
)


def facts(**kw) -> RequestFacts:
    return RequestFacts(**{"model": "smol", **kw})


@pytest.mark.parametrize(
    "req, action, may",
    [
        (facts(), "local_then_judge", True),  # config default: auto
        (facts(header_escalate="always"), "escalate_now", True),
        (facts(header_escalate="never"), "local", False),
        (facts(tenant="research"), "escalate_now", True),
        (facts(tenant="research", header_escalate="auto"), "local_then_judge", True),  # header beats tenant
        (facts(tenant="kiosk", header_escalate="always"), "local", False),  # tenant "never" is a hard limit
        (facts(tenant="clinic", header_escalate="always"), "local", False),  # local-only data wins over all
        (facts(local_only_header=True, header_escalate="always"), "local", False),
        (facts(model="qwen3.6-27b"), "escalate_now", True),  # only the region serves it
        (facts(model="qwen3.6-27b", tenant="clinic"), "refuse", False),
        (facts(model="qwen3.6-27b", header_escalate="never"), "refuse", False),
        (facts(prompt_tokens=2000, max_tokens=100), "escalate_now", True),  # does not fit locally
        (facts(prompt_tokens=2000, max_tokens=100, local_only_header=True), "local", False),
    ],
)
def test_decisions(req: RequestFacts, action: str, may: bool):
    d = decide(CFG, req)
    assert (d.action, d.may_escalate) == (action, may), d.reason


def test_mode_precedence_and_disabled_region():
    assert decide(CFG, facts()).mode == "async"
    assert decide(CFG, facts(tenant="research")).mode == "sync"
    assert decide(CFG, facts(tenant="research", header_mode="async")).mode == "async"
    off = PolicyConfig(regional_enabled=False, default="always", local_model="smol",
                       regional_models=frozenset({"big"}))
    assert decide(off, facts()) == Decision("local", "async", "no regional endpoint configured", False)
    assert decide(off, facts(model="big")).action == "refuse"


def test_judge_names_the_signal():
    s = Signals(mean_logprob=-0.5, min_logprob=-5.0, quantile_logprob=-2.5, neg_mean_entropy=-0.3, length=9)
    assert judge(Thresholds(quantile_logprob=-2.0), s) == (True, "quantile_logprob -2.500 is below -2")
    assert judge(Thresholds(quantile_logprob=-3.0, mean_logprob=-1.0), s) == (False, "confident enough")
    assert judge(Thresholds(), s) == (False, "confident enough")


@pytest.mark.parametrize(
    "headers, param",
    [
        ({"X-Appliance-Escalate": "sometimes"}, "X-Appliance-Escalate"),
        ({"X-Appliance-Escalation-Mode": "later"}, "X-Appliance-Escalation-Mode"),
        ({"X-Appliance-Data": "secret"}, "X-Appliance-Data"),
    ],
)
def test_bad_header_values_name_the_header(headers, param):
    with pytest.raises(PolicyError) as exc:
        parse_headers(headers)
    assert exc.value.param == param


def test_headers_are_case_insensitive():
    assert parse_headers({"x-appliance-escalate": "ALWAYS", "X-APPLIANCE-DATA": "Local-Only"}) == ("always", None, True)
    assert parse_headers({}) == (None, None, False)
