"""Probation's verdicts: a death of the new engine, or more 5xx answers than upgrade.probation_max_error_share
once upgrade.probation_min_requests were answered, end it early; a quiet one lasts its whole time."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

from appliance.upgrade.upgrader import Upgrader


def _upgrader(probation_s: float, share: float = 0.2, min_requests: int = 10) -> Upgrader:
    u = object.__new__(Upgrader)  # only what _probation reads: the section and the metrics' plain counts
    u.state = SimpleNamespace(cfg=SimpleNamespace(upgrade=SimpleNamespace(  # type: ignore[assignment]
        probation_s=probation_s, probation_max_error_share=share, probation_min_requests=min_requests)))
    u.metrics = SimpleNamespace(totals=collections.Counter())  # type: ignore[assignment]
    return u


def _trial() -> SimpleNamespace:
    return SimpleNamespace(failed=asyncio.get_running_loop().create_future())


def test_too_many_5xx_answers_end_probation():
    async def scenario() -> str | None:
        u, trial = _upgrader(30), _trial()
        u.metrics.totals.update(finished=100, failed_5xx=50)  # before probation: not counted

        async def traffic() -> None:
            await asyncio.sleep(0.2)
            u.metrics.totals.update(finished=12, failed_5xx=3)  # 25% of 12 answers

        asyncio.get_running_loop().create_task(traffic())
        return await asyncio.wait_for(u._probation(trial), 5)  # type: ignore[arg-type]

    reason = asyncio.run(scenario())
    assert reason is not None and "3 of 12 answers failed (5xx)" in reason


def test_few_answers_or_a_low_share_pass():
    async def scenario() -> tuple[str | None, str | None]:
        u, trial = _upgrader(1.5), _trial()

        async def few_answers() -> None:
            u.metrics.totals.update(finished=9, failed_5xx=9)  # all failed, but fewer than the minimum

        asyncio.get_running_loop().create_task(few_answers())
        few = await u._probation(trial)  # type: ignore[arg-type]
        u2, trial2 = _upgrader(1.5), _trial()
        u2.metrics.totals.update(finished=0)

        async def traffic() -> None:
            u2.metrics.totals.update(finished=50, failed_5xx=5)  # 10%

        asyncio.get_running_loop().create_task(traffic())
        return few, await u2._probation(trial2)  # type: ignore[arg-type]

    assert asyncio.run(scenario()) == (None, None)


def test_a_death_ends_probation_at_once():
    async def scenario() -> str | None:
        u, trial = _upgrader(30), _trial()
        asyncio.get_running_loop().call_later(0.1, trial.failed.set_result, "engine exited with status 4")
        return await asyncio.wait_for(u._probation(trial), 5)  # type: ignore[arg-type]

    assert asyncio.run(scenario()) == "the new engine failed in probation: engine exited with status 4"
