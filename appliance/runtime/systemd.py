"""Talking to systemd (systemd-python): the notify protocol and journal logging.

Everything is a no-op outside systemd (no NOTIFY_SOCKET), so the daemon runs the same in a terminal.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

# While the engine starts, ask for this much more start time at every progress report.
EXTEND_BY_S = 60


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        usec = env.get("WATCHDOG_USEC")
        owner = env.get("WATCHDOG_PID")
        mine = owner is None or owner == str(os.getpid())
        # systemd's own advice: ping at half the watchdog interval.
        self.watchdog_interval_s = int(usec) / 2e6 if self.enabled and usec and usec.isdigit() and mine else None
        self._notify = None
        if self.enabled:
            from systemd import daemon  # type: ignore[attr-defined]  # systemd-python (C extension, untyped); imported only where systemd is listening

            self._notify = daemon.notify

    def send(self, *fields: str) -> None:
        if self._notify is not None:
            self._notify("\n".join(fields))

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def extend_timeout(self, seconds: float = EXTEND_BY_S) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd >= 253 match the reload to this request (Type=notify-reload).
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping: engine shutting down")


def under_systemd(environ: dict[str, str] | None = None) -> bool:
    """stderr is connected to the journal (systemd sets JOURNAL_STREAM for services)."""
    env = os.environ if environ is None else environ
    return bool(env.get("JOURNAL_STREAM") or env.get("INVOCATION_ID"))


def journal_handler() -> logging.Handler | None:
    """A handler that writes structured journal entries (extra={"REQUEST_ID": ...} becomes a field)."""
    try:
        from systemd.journal import JournalHandler
    except ImportError:
        return None
    return JournalHandler(SYSLOG_IDENTIFIER="appliance")
