"""`systemctl kill -s USR1 appliance`: the daemon writes what it is doing now to its log.

For the operator (or a failed test) asking why a request hangs while the daemon otherwise answers: the
requests in flight with their phase, every asyncio task with where it waits, and every thread's stack.
It runs on the event loop, so a loop that is itself stuck writes nothing here; the loop monitor
reports that case on its own, with the stack that held the loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import traceback
from collections.abc import Iterable
from typing import Any

HEADER = "state dump (SIGUSR1)"
END = "end of state dump"


def render(requests: Iterable[dict[str, Any]], tasks: Iterable[asyncio.Task[Any]] | None = None,
           frames: dict[int, Any] | None = None) -> str:
    requests = list(requests)
    tasks = list(asyncio.all_tasks() if tasks is None else tasks)
    frames = sys._current_frames() if frames is None else frames  # noqa: SLF001 (the documented way)
    out = [f"{HEADER}: {len(requests)} request(s) in flight, {len(tasks)} task(s), {len(frames)} thread(s)"]
    out += ["request " + json.dumps(r, sort_keys=True) for r in requests]
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.append(f"task {task.get_name()}: {_coro_name(task)}")
        out += ["    " + line.rstrip() for line in _frames_text(task.get_stack(limit=12))]
    out += thread_stacks(frames)
    out.append(END)
    return "\n".join(out)


def thread_stacks(frames: dict[int, Any] | None = None, skip: int | None = None) -> list[str]:
    """Each thread's name and innermost frames (but the thread `skip`), as lines to print."""
    frames = sys._current_frames() if frames is None else frames  # noqa: SLF001 (the documented way)
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in frames.items():
        if ident != skip:
            out.append(f"thread {names.get(ident, '?')} ({ident}):")
            out += ["    " + line.rstrip() for line in traceback.format_stack(frame, limit=12)]
    return out


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or repr(coro)


def _frames_text(frames: list[Any]) -> list[str]:
    return traceback.format_list(traceback.StackSummary.extract((f, f.f_lineno) for f in frames))
