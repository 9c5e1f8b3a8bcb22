"""The loop monitor names where a blocked event loop is stuck, and stays quiet while it turns."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from appliance.runtime.loop_monitor import LoopMonitor, explain


def _stuck_in_a_synchronous_call(seconds: float) -> None:
    time.sleep(seconds)  # what a blocking call in a request handler does to every other request


async def _scenario(block_s: float, turn_s: float, threshold_s: float = 0.5) -> list[float]:
    stalls: list[float] = []
    monitor = LoopMonitor(threshold_s=threshold_s, interval_s=0.05, on_stall=stalls.append)
    task = asyncio.create_task(monitor.run())
    await asyncio.sleep(0.2)
    if block_s:
        _stuck_in_a_synchronous_call(block_s)
    await asyncio.sleep(turn_s)  # turning again: the watcher sees the stall end
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return stalls


def test_a_blocked_loop_is_reported_with_its_stack_and_counted(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="appliance.runtime.loop_monitor"):
        stalls = asyncio.run(_scenario(block_s=1.5, turn_s=0.5))
    assert len(stalls) == 1 and 1.0 <= stalls[0] <= 10.0, stalls  # no upper bound a busy CI box would break
    blocked = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert len(blocked) == 1, caplog.text
    assert "_stuck_in_a_synchronous_call" in blocked[0]  # the operator sees where it is stuck
    again = [r.getMessage() for r in caplog.records if "turning again" in r.getMessage()]
    assert len(again) == 1 and "belongs in a thread" in again[0], again


def test_a_turning_loop_is_not_reported(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="appliance.runtime.loop_monitor"):
        stalls = asyncio.run(_scenario(block_s=0, turn_s=1.0, threshold_s=1.0))  # the daemon's threshold
    assert stalls == [] and not caplog.records


def test_a_stall_without_our_code_on_the_stack_and_without_cpu_is_the_machines():
    starved = explain(in_loop=True, cpu_s=0.1, stall_s=3.0, cpu_pressure="avg10=62.10")
    assert "short of CPU" in starved and "avg10=62.10" in starved
    # our own code on the stack, or a daemon that was busy all along: the call is to blame
    assert "belongs in a thread" in explain(in_loop=False, cpu_s=0.0, stall_s=3.0, cpu_pressure="avg10=62.10")
    assert "belongs in a thread" in explain(in_loop=True, cpu_s=2.9, stall_s=3.0, cpu_pressure=None)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_loop_waiting_in_its_own_code_is_told_from_one_running_ours(loop: str):
    """The daemon runs uvloop, whose loop is C: while it waits, the innermost Python frame is asyncio's
    runner, which must count as the loop's own code, or a stall the machine caused is blamed on a call."""
    import sys
    import threading

    import uvloop

    from appliance.runtime.loop_monitor import in_the_loops_own_code

    seen: dict[str, bool] = {}

    async def main() -> None:
        tid = threading.get_ident()

        def peek(name: str) -> None:
            seen[name] = in_the_loops_own_code(sys._current_frames()[tid])

        waiting = threading.Thread(target=lambda: (time.sleep(0.3), peek("waiting")))
        waiting.start()
        await asyncio.sleep(0.6)  # the loop waits in its own code
        waiting.join()
        busy = threading.Thread(target=lambda: (time.sleep(0.2), peek("busy")))
        busy.start()
        _stuck_in_a_synchronous_call(0.5)  # our code holds the loop
        busy.join()

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())
    assert seen == {"waiting": True, "busy": False}, seen
