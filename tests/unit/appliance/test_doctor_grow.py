"""The doctor's grow advisor (seed section 9): when the box has outgrown itself, with the measured figures,
and where to go next (the regional tier in packaging/regional/)."""

from __future__ import annotations

from appliance.ops import doctor
from appliance.ops.metrics import Metrics
from appliance.ops.traffic import TrafficSample
from appliance.store.requests import RequestRecord
from tests.unit.appliance.test_doctor import samples


def traffic(n: int = 21, step: float = 30.0, **ramps: tuple[float, float]) -> list[TrafficSample]:
    """Like `samples`, for the site's traffic counters."""
    return [TrafficSample(ts=1000.0 + i * step, **{k: a + (b - a) * i / (n - 1) for k, (a, b) in ramps.items()})
            for i in range(n)]


QUIET = samples(n=21, running=(2, 2), kv_usage=(0.2, 0.3))  # ten minutes, a tenth of the capacity busy


def grow(engine=QUIET, site=(), *, regional: bool = False) -> doctor.Finding:
    return doctor.grow(engine, list(site), capacity=16, escalation_share_max=0.3, regional_enabled=regional)


def test_a_quiet_box_is_not_outgrown_and_the_figures_say_why():
    f = grow(site=traffic(answered=(0, 400), escalations=(0, 40), gold_requests=(0, 100)))
    assert f.status == "ok", f
    assert "2.0 of 16 sessions busy" in f.summary and "10% of 400 answered requests escalated" in f.summary
    assert "0 of 100 gold requests refused" in f.summary


def test_too_little_time_is_skipped_not_judged():
    assert grow(samples(n=5, running=(16, 16)), traffic(n=5, gold_refused=(0, 50), gold_requests=(0, 50))
                ).status == "skip"


def test_busy_near_capacity_names_the_regional_tier_as_the_next_step():
    f = grow(samples(n=21, running=(15, 15), waiting=(1, 3)))
    assert f.status == "warn" and "17.0 requests in the engine on average against a capacity of 16" in f.summary
    assert "packaging/regional/" in f.advice and "[regional]" in f.advice


def test_sustained_kv_pressure_is_a_sign_a_burst_is_not():
    f = grow(samples(n=21, running=(4, 4), kv_usage=(0.85, 0.95), preemptions=(0, 12)))
    assert f.status == "warn" and "KV cache at or above 80% for 100% of the time, 12 preemptions" in f.summary
    burst = samples(n=21, running=(4, 4), kv_usage=(0.2, 0.2))
    burst[-3:] = [s.__class__(ts=s.ts, running=4, kv_usage=0.95) for s in burst[-3:]]
    assert grow(burst).status == "ok"


def test_refused_gold_work_is_a_sign():
    f = grow(site=traffic(gold_requests=(0, 200), gold_refused=(0, 5), answered=(0, 500)))
    assert f.status == "warn" and "5 of 200 gold requests refused (2.5%)" in f.summary
    assert grow(site=traffic(gold_requests=(0, 1000), gold_refused=(0, 1), answered=(0, 1000))).status == "ok"


def test_an_escalation_share_over_the_threshold_is_a_sign_once_there_is_enough_traffic():
    f = grow(site=traffic(answered=(0, 400), escalations=(0, 160)))
    assert f.status == "warn" and "40% of 400 answered requests escalated (above doctor.grow_escalation_share = 30%)" \
        in f.summary
    assert grow(site=traffic(answered=(0, 20), escalations=(0, 20))).status == "ok"  # 20 requests say nothing yet


def test_with_the_regional_tier_on_the_advice_is_to_grow_it():
    f = grow(site=traffic(answered=(0, 400), escalations=(0, 160)), regional=True)
    assert f.status == "warn" and f.advice.startswith("grow the regional cluster") and "modelservers.yaml" in f.advice


def test_the_traffic_sample_counts_what_the_gateway_and_the_cascade_saw():
    m = Metrics()
    for status, cls in [(200, "gold"), (429, "gold"), (200, "silver"), (503, None), (200, "bronze")]:
        m.observe_request(RequestRecord(id="r", ts=0.0, route="/v1/chat/completions", model="m", status=status,
                                        stream=False), cls)
    m.observe_decision("gold", "queue", "")
    m.observe_decision("gold", "reject", "ttft_target_missed_in_queue")
    m.observe_decision("silver", "reject", "class_full")
    s = m.traffic(5.0, {"local": 9, "escalated": 2, "queued": 3, "fallback": 1, "failed": 1, "outbox_full": 1})
    assert s == TrafficSample(ts=5.0, answered=3, escalations=7, gold_requests=2, gold_refused=1)
