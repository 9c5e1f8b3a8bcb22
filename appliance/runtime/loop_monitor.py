"""Notices an event loop that stops turning, and says where it was stuck.

Every request, stream relay, engine poll and systemd ping shares the daemon's one event loop, so
anything that blocks it (a synchronous call that should have gone to a thread, a CPU-bound step)
stalls them all at once. The systemd watchdog only fires on a stall longer than WatchdogSec, and then
says nothing about its cause; this monitor logs the loop thread's stack while the stall is going on,
and counts stalls in the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)


class LoopMonitor:
    def __init__(self, threshold_s: float = 1.0, interval_s: float = 0.25,
                 on_stall: Callable[[float], None] = lambda seconds: None) -> None:
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.on_stall = on_stall  # called with a stall's length once the loop turns again
        self._beat = time.monotonic()
        self._beat_cpu = time.process_time()
        self._loop_thread: int | None = None
        self._stop = threading.Event()

    async def run(self) -> None:
        """The heartbeat, in the loop; the watcher, in a thread of its own (a stuck loop cannot watch itself)."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._stop.clear()
        watcher = threading.Thread(target=self._watch, name="loop-monitor", daemon=True)
        watcher.start()
        try:
            while True:
                self._beat, self._beat_cpu = time.monotonic(), time.process_time()
                await asyncio.sleep(self.interval_s)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        longest = 0.0  # of the stall going on, 0 when none is
        cpu_at_start, in_loop = 0.0, False
        while not self._stop.wait(self.interval_s):
            beat, beat_cpu = self._beat, self._beat_cpu
            lag = time.monotonic() - beat
            if lag > self.threshold_s:
                if not longest:
                    cpu_at_start = beat_cpu
                    frame = self._loop_frame()
                    in_loop = frame is not None and in_the_loops_own_code(frame)
                    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(unavailable)"
                    log.warning("event loop blocked for %.1f s so far; every request waits. The loop is at:\n%s",
                                lag, stack)
                longest = max(longest, lag)
            elif longest:
                log.warning("event loop turning again after a %.1f s stall: %s", longest,
                            explain(in_loop, time.process_time() - cpu_at_start, longest, _cpu_pressure()))
                self.on_stall(longest)
                longest = 0.0

    def _loop_frame(self) -> FrameType | None:
        return sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None


def in_the_loops_own_code(frame: FrameType) -> bool:
    """Whether the loop thread's innermost Python frame is the event loop's own machinery, not a call of
    ours. asyncio's pure-Python loop shows `_run_once`/`select`; uvloop's loop is C, so while it runs the
    innermost Python frame is the runner that started it (asyncio.runners' `run` in uvloop.run)."""
    module = frame.f_globals.get("__name__", "")
    return module.split(".")[0] in ("asyncio", "selectors", "uvloop")


def explain(in_loop: bool, cpu_s: float, stall_s: float, cpu_pressure: str | None) -> str:
    """What a stall was: a daemon stuck in its own code, or one the machine gave no CPU."""
    if in_loop and cpu_s < stall_s / 4:
        return (f"the loop was not running any of the daemon's code and the daemon got {cpu_s:.1f} s of CPU: "
                f"the machine is short of CPU (CPU pressure {cpu_pressure or 'unknown'}); look at what else runs")
    return (f"the daemon ran {cpu_s:.1f} s of CPU in it; the stack logged when it began shows the call that "
            "held the loop, which belongs in a thread")


def _cpu_pressure() -> str | None:
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().split()[1]  # "avg10=…" of "some": the share of time tasks waited for a CPU
    except (OSError, IndexError):
        return None
