"""The daemon acting on the doctor's speculative-decoding recipe ([doctor] disable_decayed_speculation).

The supervisor is replaced by a recorder: what is under test is the decision and the new plan handed
to it; the relaunch itself is tested against real processes in test_guard_and_supervisor.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

from appliance.api.dialects import COMPLETIONS
from appliance.boot.assembly import build
from appliance.boot.config import load
from appliance.boot.planning import plan_for_config
from appliance.engine.supervisor import EngineState, EngineSupervisor
from appliance.engine.watch import EngineSample
from appliance.ops.status import doctor_report, status
from appliance.runtime.daemon import Daemon
from kvbudget import probe
from kvbudget.gpu import Discovery
from kvbudget.plan_types import PlanError
from tests.support import model_stand_in, write_config


class RecordingSupervisor(EngineSupervisor):
    def __init__(self, cfg, engine_args) -> None:
        super().__init__(cfg, engine_args)
        self.relaunched: list[tuple[list[str], str]] = []

    async def relaunch(self, engine_args, reason: str, drain=None) -> None:
        if drain is not None:
            await drain()
        self.relaunched.append((list(engine_args), reason))


def _daemon(tmp_path: Path, act: bool, doctor: str = "") -> tuple[Daemon, RecordingSupervisor]:
    path = write_config(tmp_path, model=model_stand_in(tmp_path), extra=f'[targets]\nworkload = "code"\n'
                                        f"[doctor]\ndisable_decayed_speculation = {str(act).lower()}\n{doctor}")
    cfg = load(path)
    site_plan = plan_for_config(cfg, Discovery(error="no NVIDIA driver"), ask_vllm=False)
    assert site_plan.plan.speculative.method == "ngram"  # code on a tight budget: n-gram drafts
    recorder = RecordingSupervisor(cfg, site_plan.plan.vllm_args)
    recorder.status.state = EngineState.READY
    return build(cfg, site_plan, supervisor=recorder), recorder


def _feed(daemon: Daemon, accepted_share: float) -> None:
    now = time.time()
    for i in range(11):
        drafted = 200.0 * i
        daemon.engine_watch.samples.append(EngineSample(ts=now - 300 + 30 * i, spec_draft_tokens=drafted,
                                                        spec_accepted=drafted * accepted_share,
                                                        generation_tokens=100.0 * i))


def test_decayed_speculation_is_turned_off_and_the_engine_relaunched(tmp_path: Path):
    daemon, sup = _daemon(tmp_path, act=True)
    _feed(daemon, 0.1)
    action = asyncio.run(daemon.remedies.act())
    assert action and "ngram" in action and "acceptance 10%" in action
    [(args, reason)] = sup.relaunched
    assert "--speculative-config" not in args and reason == action
    assert "--kv-cache-memory-bytes" in args  # the rest of the plan is unchanged
    shown = status(daemon.state, daemon.supervisor, daemon.cascade)["plan"]["speculative"]
    assert shown == {"method": "none", "reason": action}
    assert daemon.metrics.doctor_actions.labels("speculative_off")._value.get() == 1
    assert not daemon.engine_watch.samples  # the old engine's counters are not compared with the new one's
    # Done once: with speculation off there is nothing more to do.
    _feed(daemon, 0.1)
    assert asyncio.run(daemon.remedies.act()) is None and len(sup.relaunched) == 1
    assert daemon.cfg.targets.speculative == "auto"  # the file's setting; a restart brings speculation back


def test_healthy_speculation_is_left_alone(tmp_path: Path):
    daemon, sup = _daemon(tmp_path, act=True)
    _feed(daemon, 0.7)
    assert asyncio.run(daemon.remedies.act()) is None and not sup.relaunched
    assert daemon.state.site_plan.plan.speculative.method == "ngram"


def test_decayed_speculation_is_only_reported_unless_configured(tmp_path: Path):
    daemon, sup = _daemon(tmp_path, act=False)
    _feed(daemon, 0.1)
    assert asyncio.run(daemon.remedies.act()) is None and not sup.relaunched
    found = {f["check"]: f for f in asyncio.run(doctor_report(daemon.state, daemon.supervisor, daemon.engine_watch))["findings"]}
    assert found["speculative"]["status"] == "warn"  # still advised, for the operator to decide


def _answering(daemon):
    """A request the local engine is answering, as the gateway holds one."""
    ex = daemon.gateway.exchanges.open("req-1", COMPLETIONS, "silver", None)
    ex.hold(None)
    return ex


def test_the_relaunch_waits_for_the_answers_in_flight(tmp_path: Path):
    """A planned relaunch refuses new work, then lets the engine finish what it is answering."""
    daemon, sup = _daemon(tmp_path, act=True)
    _feed(daemon, 0.1)

    async def scenario() -> None:
        answering = _answering(daemon)
        acting = asyncio.create_task(daemon.remedies.act())
        await asyncio.sleep(0.5)
        assert not acting.done() and not sup.relaunched, "the engine was relaunched under a request in flight"
        answering.close(200)
        assert await asyncio.wait_for(acting, 5)
        assert len(sup.relaunched) == 1 and daemon.gateway.local_in_flight == 0

    asyncio.run(scenario())


def test_the_drain_is_bounded(tmp_path: Path, caplog):
    """A request that outlasts relaunch_drain_s does not hold the relaunch back for ever."""
    daemon, sup = _daemon(tmp_path, act=True, doctor="relaunch_drain_s = 0.3\n")
    _feed(daemon, 0.1)

    async def scenario() -> None:
        _answering(daemon)  # never ends
        t = time.monotonic()
        assert await daemon.remedies.act()
        assert 0.3 <= time.monotonic() - t < 3 and len(sup.relaunched) == 1

    asyncio.run(scenario())
    assert "1 request(s) still running after 0.3s are cut off by the relaunch" in caplog.text


def test_the_relaunch_uses_the_plan_made_at_start(tmp_path: Path, monkeypatch):
    """Planning anew would run the vLLM probe while the engine keeps every core busy (minutes on 2 cores)."""
    daemon, sup = _daemon(tmp_path, act=True)
    daemon.state.site_plan = replace(daemon.state.site_plan, asked_vllm=True)

    def no_probe(*a, **k):
        raise AssertionError("the doctor ran the vLLM probe again")

    monkeypatch.setattr(probe, "ask_many", no_probe)
    _feed(daemon, 0.1)
    assert asyncio.run(daemon.remedies.act())
    [(args, _)] = sup.relaunched
    assert "--speculative-config" not in args


def test_no_relaunch_when_the_plan_without_speculation_cannot_run(tmp_path: Path, caplog):
    daemon, sup = _daemon(tmp_path, act=True)
    daemon.state.site_plan = replace(daemon.state.site_plan, without_speculation=PlanError("vLLM refuses this plan: because"))
    _feed(daemon, 0.1)
    assert asyncio.run(daemon.remedies.act()) is None and not sup.relaunched
    assert daemon.state.site_plan.plan.speculative.method == "ngram"
    assert "cannot be planned without it: vLLM refuses this plan: because" in caplog.text


def test_one_probe_run_answers_for_both_plans(tmp_path: Path, monkeypatch):
    """The plan and its speculation-free twin are asked together: vLLM is imported once at start."""
    cfg = load(write_config(tmp_path, model=model_stand_in(tmp_path), extra='[targets]\nworkload = "code"\n'))
    calls: list[list[probe.Question]] = []

    def recording(questions, device=None, python=None, timeout_s=0):
        calls.append(list(questions))
        return [probe.VllmRefused("not this one") if "--speculative-config" not in q.args
                else probe.EmulationGap("stand-in") for q in questions]

    monkeypatch.setattr(probe, "ask_many", recording)
    site = plan_for_config(cfg, Discovery(error="no NVIDIA driver"))
    [questions] = calls
    assert ["--speculative-config" in q.args for q in questions] == [True, False]
    assert site.plan.speculative.method == "ngram" and "stand-in" in " ".join(site.plan.notes)
    assert isinstance(site.without_speculation, PlanError) and "not this one" in str(site.without_speculation)


def test_the_grow_advisor_reads_the_traffic_the_daemon_sampled_beside_the_engine(tmp_path: Path):
    """Wiring: each engine sample the watch takes also samples the gateway's counts, and the doctor route
    judges them (appliance.ops.doctor.grow)."""
    import httpx

    from appliance.store.requests import RequestRecord

    daemon, _ = _daemon(tmp_path, act=False)
    now = time.time()
    for i in range(21):
        for answered, cls in [(200, "gold"), (200, "silver"), (429, "gold")] if i else []:
            daemon.metrics.observe_request(RequestRecord(id=f"r{i}", ts=now, route="/v1/chat/completions", model="m",
                                                         status=answered, stream=False), cls)
            if answered == 429:
                daemon.metrics.observe_decision("gold", "reject", "ttft_target_missed_in_queue")
        daemon.engine_watch.accept(EngineSample(ts=now - 600 + 30 * i, running=1, generation_tokens=10.0 * i))

    async def ask() -> dict:
        transport = httpx.ASGITransport(app=daemon.app, client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://appliance") as c:
            return (await c.get("/v1/appliance/doctor", timeout=60)).json()

    found = {f["check"]: f for f in asyncio.run(ask())["findings"]}
    assert found["grow"]["status"] == "warn", found["grow"]
    assert "20 of 40 gold requests refused (50.0%)" in found["grow"]["summary"]
    assert "packaging/regional/" in found["grow"]["advice"]
