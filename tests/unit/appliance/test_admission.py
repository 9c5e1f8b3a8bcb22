"""Admission control: the pure decision and the gate's ordering, reservation, deadlines and cancellation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from appliance.api.admission import (
    AdmissionConfig,
    AdmissionGate,
    AdmissionRejected,
    ClassPolicy,
    Load,
    Request,
    decide,
    has_free_slot,
    usable_slots,
)

CFG = AdmissionConfig(
    capacity=10,
    classes={
        "gold": ClassPolicy(ttft_target_s=2.0, max_tokens=2048, queue_limit=50, reserved_share=0.3),
        "silver": ClassPolicy(ttft_target_s=4.0, max_tokens=1024, queue_limit=20),
        "bronze": ClassPolicy(ttft_target_s=8.0, max_tokens=256, queue_limit=5),
    },
)


def load(in_flight=None, queued=None, service=2.0, prefill=1000.0, kv=0.0, recent=()) -> Load:
    return Load(in_flight or {}, queued or {}, service, prefill, kv, frozenset(recent))


def test_one_class_alone_uses_every_slot():
    assert has_free_slot(CFG, load({"bronze": 9}), "bronze")
    assert not has_free_slot(CFG, load({"bronze": 10}), "bronze")
    assert usable_slots(CFG, load({"silver": 3}), "silver") == 10


def test_a_reserved_share_holds_while_its_class_is_active():
    assert CFG.reserved_slots("gold") == 3
    # Gold has one request in flight: two more of its slots stay free for it.
    assert has_free_slot(CFG, load({"gold": 1, "bronze": 6}), "bronze")
    assert not has_free_slot(CFG, load({"gold": 1, "bronze": 7}), "bronze")
    # ... and for reserve_memory_s after its last request ended, or while gold waits.
    assert not has_free_slot(CFG, load({"bronze": 7}, recent={"gold"}), "silver")
    assert not has_free_slot(CFG, load({"bronze": 7}, {"gold": 1}), "silver")
    assert has_free_slot(CFG, load({"bronze": 7}), "silver")  # gold idle: its share is lent


def test_a_class_takes_its_lent_reserve_back_at_once_over_the_capacity():
    full_of_bronze = load({"bronze": 10})
    assert has_free_slot(CFG, full_of_bronze, "gold") and not has_free_slot(CFG, full_of_bronze, "silver")
    assert not has_free_slot(CFG, load({"bronze": 10, "gold": 3}), "gold")  # its whole reserve taken back
    assert CFG.engine_max_num_seqs == 13  # so the engine has room for all three


def test_nearly_full_kv_admits_only_what_can_preempt_a_lower_class():
    assert not has_free_slot(CFG, load(kv=0.97), "bronze")
    assert not has_free_slot(CFG, load(kv=0.97), "gold")  # nothing lower to preempt: vLLM would preempt gold
    assert has_free_slot(CFG, load({"bronze": 2}, kv=0.97), "gold")


def test_the_wait_is_predicted_on_the_real_capacity():
    # The case: 16 slots all silver, 16 silver waiting, a 3.3 s answer; gold idle, its share lent.
    cfg = AdmissionConfig(16, {"gold": ClassPolicy(2.0, None, 64, 0.25), "silver": ClassPolicy(5.0, None, 64)})
    v = decide(cfg, load({"silver": 16}, {"silver": 16}, service=3.3), Request("silver", 0))
    assert v.action == "queue" and v.predicted_ttft_s == pytest.approx(17 * 3.3 / 16)
    # Requests of a class that took its reserve back over the capacity end before a slot frees for others.
    v = decide(cfg, load({"silver": 16, "gold": 4}, service=3.3), Request("silver", 0))
    assert v.predicted_ttft_s == pytest.approx((1 + 4) * 3.3 / 16)


def test_admit_when_a_slot_is_free_and_nobody_waits():
    v = decide(CFG, load({"silver": 2}), Request("silver", prompt_tokens=500))
    assert v.action == "admit" and v.predicted_ttft_s == 0.5  # 500 tokens at 1000 tokens/s


def test_over_the_class_token_limit_is_400():
    v = decide(CFG, load(), Request("bronze", 10, max_tokens=300))
    assert (v.action, v.status, v.code) == ("reject", 400, "max_tokens_over_class_limit")


def test_queue_when_the_target_can_still_be_met():
    # bronze: usable slots 7, service 2 s; 2 ahead (gold 1, silver 1... bronze waits behind all) -> (2+1)*2/7
    v = decide(CFG, load({"bronze": 7}, {"gold": 1, "silver": 1}), Request("bronze", 1000))
    assert v.action == "queue" and v.predicted_ttft_s == pytest.approx(3 * 2.0 / 7 + 1.0)


def test_refuse_at_once_when_the_target_cannot_be_met():
    v = decide(CFG, load({"bronze": 10}, {"silver": 20}, service=5.0), Request("bronze", 100))
    predicted = 21 * 5.0 / 10 + 0.1
    assert (v.action, v.status, v.code) == ("reject", 429, "ttft_target_unreachable")
    assert v.predicted_ttft_s == pytest.approx(predicted) and v.retry_after_s == 3  # ceil(10.6 - 8)
    assert "exceeds the bronze target 8s" in v.message


def test_full_queue_is_429():
    v = decide(CFG, load({"bronze": 7}, {"bronze": 5}), Request("bronze", 10))
    assert (v.status, v.code, v.retry_after_s) == (429, "queue_full", 2)


def test_gold_is_not_queued_behind_lower_classes():
    v = decide(CFG, load({"bronze": 7}, {"silver": 5, "bronze": 5}), Request("gold", 10))
    assert v.action == "admit"


def test_bad_configuration():
    with pytest.raises(ValueError, match="unknown classes"):
        AdmissionConfig(4, {"platinum": ClassPolicy(1, 1, 1)})
    with pytest.raises(ValueError, match="more than the capacity"):
        AdmissionConfig(4, {"gold": ClassPolicy(1, 1, 1, 0.8), "silver": ClassPolicy(1, 1, 1, 0.5)})


# -- the gate ----------------------------------------------------------------------------------------

ONE_SLOT = AdmissionConfig(capacity=1, classes={
    "gold": ClassPolicy(5.0, 100, 10), "silver": ClassPolicy(5.0, 100, 10), "bronze": ClassPolicy(5.0, 100, 10)})


def test_freed_slots_go_to_gold_then_silver_then_bronze():
    async def scenario() -> list[str]:
        gate = AdmissionGate(ONE_SLOT, service_time_s=0.1, prefill_tokens_per_s=1e6)
        first = await gate.acquire(Request("bronze", 1))
        order: list[str] = []

        async def wait(cls: str) -> None:
            t = await gate.acquire(Request(cls, 1))
            order.append(cls)
            gate.release(t)

        tasks = [asyncio.create_task(wait(c)) for c in ("bronze", "silver", "gold")]
        await asyncio.sleep(0.01)
        assert gate.load().queued == {"gold": 1, "silver": 1, "bronze": 1}
        gate.release(first)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["gold", "silver", "bronze"]


def test_a_queued_request_that_misses_its_target_is_refused_not_left_waiting():
    cfg = AdmissionConfig(capacity=1, classes={"silver": ClassPolicy(0.2, 100, 10)})

    async def scenario() -> tuple[AdmissionRejected, dict]:
        gate = AdmissionGate(cfg, service_time_s=0.05, prefill_tokens_per_s=1e6)
        await gate.acquire(Request("silver", 1))  # never released
        with pytest.raises(AdmissionRejected) as exc:
            await gate.acquire(Request("silver", 1))
        return exc.value, gate.load().queued

    err, queued = asyncio.run(scenario())
    assert err.verdict.code == "ttft_target_missed_in_queue" and err.verdict.status == 429
    assert queued == {"silver": 0}


def test_a_client_that_leaves_the_queue_frees_its_place():
    async def scenario() -> dict:
        gate = AdmissionGate(ONE_SLOT, service_time_s=0.1, prefill_tokens_per_s=1e6)
        held = await gate.acquire(Request("gold", 1))
        waiting = asyncio.create_task(gate.acquire(Request("silver", 1)))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.release(held)
        return {"queued": gate.load().queued["silver"], "in_flight": sum(gate.in_flight.values())}

    assert asyncio.run(scenario()) == {"queued": 0, "in_flight": 0}


def test_new_settings_admit_the_waiting_at_once():
    """The doctor's relaunch on a plan with more sequences reconfigures the gate: a request waiting for the
    one slot is admitted then, not at the next release."""
    async def scenario() -> bool:
        gate = AdmissionGate(ONE_SLOT, service_time_s=0.1, prefill_tokens_per_s=1e6)
        await gate.acquire(Request("silver", 1))  # held throughout
        waiting = asyncio.create_task(gate.acquire(Request("silver", 1)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        gate.reconfigure(dataclasses.replace(ONE_SLOT, capacity=2))
        await asyncio.sleep(0.01)
        return waiting.done() and waiting.result().cls == "silver"

    assert asyncio.run(scenario())


def test_service_time_average_follows_releases():
    now = [0.0]
    gate = AdmissionGate(ONE_SLOT, service_time_s=1.0, clock=lambda: now[0], alpha=0.5)
    t = asyncio.run(gate.acquire(Request("gold", 1)))
    now[0] = 3.0
    gate.release(t)
    gate.release(t)  # twice is harmless
    assert gate.service_time_s == 2.0 and gate.in_flight["gold"] == 0


def test_a_reserve_is_lent_to_the_queue_when_its_class_has_been_away_long_enough():
    cfg = AdmissionConfig(capacity=2, reserve_memory_s=0.3, classes={
        "gold": ClassPolicy(5.0, 100, 10, reserved_share=0.5), "silver": ClassPolicy(5.0, 100, 10)})

    async def scenario() -> tuple[bool, bool]:
        gate = AdmissionGate(cfg, service_time_s=0.1, prefill_tokens_per_s=1e6)
        gate.release(await gate.acquire(Request("gold", 1)))  # gold was here a moment ago
        await gate.acquire(Request("silver", 1))
        second = asyncio.create_task(gate.acquire(Request("silver", 1)))
        await asyncio.sleep(0.1)
        held_for_gold = not second.done()
        await asyncio.wait_for(second, 2.0)  # woken when gold's memory runs out, not by another release
        return held_for_gold, second.done()

    assert asyncio.run(scenario()) == (True, True)


def test_a_request_of_n_choices_takes_n_slots_and_waits_for_room_for_all():
    """Issue 15: a bronze request with n=4000 took one slot and filled the engine. Each choice is a
    sequence in the engine: admission counts it as one, and a request needing more than fit waits."""
    cfg = AdmissionConfig(capacity=4, classes={"silver": ClassPolicy(30.0, None, 10),
                                               "bronze": ClassPolicy(30.0, None, 10)})
    assert decide(cfg, load({"silver": 1}), Request("bronze", 10, seqs=3)).action == "admit"
    assert decide(cfg, load({"silver": 2}), Request("bronze", 10, seqs=3)).action == "queue"
    too_many = decide(cfg, load(), Request("bronze", 10, seqs=5))
    assert (too_many.status, too_many.code) == (400, "too_many_choices")

    async def scenario():
        gate = AdmissionGate(cfg)
        wide = await gate.acquire(Request("bronze", 10, seqs=3))
        assert gate.in_flight["bronze"] == 3
        one = await gate.acquire(Request("silver", 10))
        waiting = asyncio.ensure_future(gate.acquire(Request("bronze", 10, seqs=2)))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 4 of 4 slots in use
        gate.release(one)
        await asyncio.sleep(0.01)
        assert not waiting.done()  # one free slot is not room for two
        gate.release(wide)
        ticket = await asyncio.wait_for(waiting, 1)
        assert gate.in_flight["bronze"] == 2
        gate.release(ticket)
        assert gate.in_flight["bronze"] == 0

    asyncio.run(scenario())


def test_with_refuse_late_off_a_late_request_is_queued_with_its_prediction_and_waits_past_its_target():
    """The calibration mode (admission.refuse_late = false): nothing refused for lateness, the prediction kept."""
    late = dataclasses.replace(CFG, refuse_late=False)
    v = decide(late, load({"bronze": 10}, {"silver": 20}, service=5.0), Request("bronze", 100))
    assert v.action == "queue" and v.predicted_ttft_s == pytest.approx(21 * 5.0 / 10 + 0.1)
    assert decide(late, load({"bronze": 7}, {"bronze": 5}), Request("bronze", 10)).code == "queue_full"  # still

    cfg = AdmissionConfig(capacity=1, classes={"silver": ClassPolicy(0.2, 100, 10)}, refuse_late=False)

    async def scenario() -> tuple[float, float, float]:
        gate = AdmissionGate(cfg, service_time_s=0.05, prefill_tokens_per_s=1e6)
        first = await gate.acquire(Request("silver", 1))
        waiting = asyncio.create_task(gate.acquire(Request("silver", 1)))
        await asyncio.sleep(0.4)  # twice the target: with refuse_late on it would have been refused by now
        assert not waiting.done()
        gate.release(first)
        second = await waiting
        return first.predicted_s, second.predicted_s, gate.service_time_s

    first_p, second_p, _ = asyncio.run(scenario())
    assert first_p == pytest.approx(1e-6) and second_p == pytest.approx(1 * 0.05 / 1 + 1e-6)  # one slot to wait for
