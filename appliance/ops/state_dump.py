"""`systemctl kill -s USR1 appliance`: the daemon writes what it is doing now to its log.

For the operator (or a failed test) asking why a request hangs while the daemon otherwise answers: the
requests in flight with their phase, every asyncio task with where it waits, and every thread's stack.
It runs on the event loop, so a loop that is itself stuck writes nothing here; the loop monitor
reports that case on its own, with the stack that held the loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HEADER = "state dump (SIGUSR1)"
END = "end of state dump"


def render(requests: Iterable[dict[str, Any]], tasks: Iterable[asyncio.Task[Any]] | None = None,
           frames: dict[int, Any] | None = None) -> str:
    requests = list(requests)
    tasks = list(asyncio.all_tasks() if tasks is None else tasks)
    frames = sys._current_frames() if frames is None else frames
    out = [f"{HEADER}: {len(requests)} request(s) in flight, {len(tasks)} task(s), {len(frames)} thread(s)"]
    out += ["request " + json.dumps(r, sort_keys=True) for r in requests]
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.append(f"task {task.get_name()}: {_coro_name(task)}")
        out += ["    " + line.rstrip() for line in _frames_text(task.get_stack(limit=12))]
    out += thread_stacks(frames)
    out.append(END)
    return "\n".join(out)


def thread_stacks(frames: dict[int, Any] | None = None, skip: int | None = None) -> list[str]:
    """Each thread's name, what the kernel says of it, and its innermost frames (but the thread `skip`)."""
    frames = sys._current_frames() if frames is None else frames
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in frames.items():
        if ident != skip:
            thread = threads.get(ident)
            kernel = kernel_view(thread.native_id) if thread is not None and thread.native_id else None
            seen = f" [{kernel}]" if kernel else ""
            out.append(f"thread {thread.name if thread else '?'} ({ident}){seen}:")
            out += ["    " + line.rstrip() for line in traceback.format_stack(frame, limit=12)]
    return out


def kernel_view(tid: int) -> str | None:
    """One thread as Linux sees it: running or sleeping, the kernel function it sleeps in, and the CPU
    seconds it has used. A Python stack ends where C code begins; this tells a thread spinning in C
    (running, CPU growing) from one waiting for a lock or the GIL (sleeping in a futex wait) or for I/O.
    None where /proc does not say (not Linux, or the thread has gone)."""
    try:
        task = Path(f"/proc/self/task/{tid}")
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        wchan = (task / "wchan").read_text().strip()
    except (OSError, IndexError):
        return None
    state, ticks = fields[0], int(fields[11]) + int(fields[12])  # fields 3, 14 (utime) and 15 (stime) of stat
    waits = f" in {wchan}" if wchan not in ("", "0") else ""
    return f"{state}{waits}, cpu {ticks / os.sysconf('SC_CLK_TCK'):.2f}s"


def _coro_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or repr(coro)


def _frames_text(frames: list[Any]) -> list[str]:
    return traceback.format_list(traceback.StackSummary.extract((f, f.f_lineno) for f in frames))
