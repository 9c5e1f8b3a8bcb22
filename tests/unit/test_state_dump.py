"""The SIGUSR1 state dump: requests in flight, where each task waits, every thread's stack."""

from __future__ import annotations

import asyncio
import threading

from appliance import state_dump


async def _parked_in_a_named_coroutine(gate: asyncio.Event) -> None:
    await gate.wait()


def test_the_dump_names_requests_tasks_and_threads():
    parked = threading.Event()
    thread = threading.Thread(target=parked.wait, name="held-thread", daemon=True)
    thread.start()

    async def scenario() -> str:
        gate = asyncio.Event()
        task = asyncio.create_task(_parked_in_a_named_coroutine(gate), name="held-task")
        await asyncio.sleep(0)  # let it reach its await
        text = state_dump.render([{"id": "req-1", "phase": "streaming"}])
        gate.set()
        await task
        return text

    try:
        text = asyncio.run(scenario())
    finally:
        parked.set()
        thread.join(5)
    lines = text.splitlines()
    assert lines[0].startswith(state_dump.HEADER) and "1 request(s) in flight" in lines[0]
    assert lines[-1] == state_dump.END
    assert 'request {"id": "req-1", "phase": "streaming"}' in lines
    task_at = lines.index("task held-task: _parked_in_a_named_coroutine")
    assert "await gate.wait()" in "\n".join(lines[task_at:task_at + 4])  # where it waits
    thread_at = next(i for i, line in enumerate(lines) if line.startswith("thread held-thread ("))
    stack = []
    for line in lines[thread_at + 1:]:
        if not line.startswith("    "):
            break
        stack.append(line)
    assert stack and stack[-2].endswith(", in wait")  # the innermost frame: Event.wait, where it is parked
