"""The SIGUSR1 state dump: requests in flight, where each task waits, every thread's stack."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

from appliance.ops import state_dump


async def _parked_in_a_named_coroutine(gate: asyncio.Event) -> None:
    await gate.wait()


def _until_asleep(thread: threading.Thread, timeout: float = 10) -> None:
    """Until the kernel has put the thread to sleep (a started thread runs a while before it parks)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
        assert time.monotonic() < deadline, "the thread never went to sleep"
        time.sleep(0.01)


def test_the_dump_names_requests_tasks_and_threads():
    parked = threading.Event()
    thread = threading.Thread(target=parked.wait, name="held-thread", daemon=True)
    thread.start()
    _until_asleep(thread)

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
    # What the kernel says of it: asleep (in a futex wait, where /proc names it), and its CPU time; the
    # thread that wrote the dump was running.
    assert re.search(r"\[S( in \w+)?, cpu \d+\.\d\ds\]:$", lines[thread_at]), lines[thread_at]
    writer = next(line for line in lines if line.startswith(f"thread MainThread ({threading.main_thread().ident})"))
    assert re.search(r"\[R, cpu \d+\.\d\ds\]:$", writer), writer
    stack = []
    for line in lines[thread_at + 1:]:
        if not line.startswith("    "):
            break
        stack.append(line)
    assert stack and stack[-2].endswith(", in wait")  # the innermost frame: Event.wait, where it is parked
