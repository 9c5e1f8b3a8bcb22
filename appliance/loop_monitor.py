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

log = logging.getLogger(__name__)


class LoopMonitor:
    def __init__(self, threshold_s: float = 1.0, interval_s: float = 0.25,
                 on_stall: Callable[[float], None] = lambda seconds: None) -> None:
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.on_stall = on_stall  # called with a stall's length once the loop turns again
        self._beat = time.monotonic()
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
                self._beat = time.monotonic()
                await asyncio.sleep(self.interval_s)
        finally:
            self._stop.set()

    def _watch(self) -> None:
        longest = 0.0  # of the stall going on, 0 when none is
        while not self._stop.wait(self.interval_s):
            lag = time.monotonic() - self._beat
            if lag > self.threshold_s:
                if not longest:
                    log.warning("event loop blocked for %.1f s so far; every request waits. The loop is at:\n%s",
                                lag, self._loop_stack())
                longest = max(longest, lag)
            elif longest:
                log.warning("event loop turning again after a %.1f s stall", longest)
                self.on_stall(longest)
                longest = 0.0

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(stack unavailable)"
