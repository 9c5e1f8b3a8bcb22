"""Logging setup: structured journal entries under systemd, one line per event on stderr otherwise.

Records go through a queue to a writer thread (the standard library's QueueHandler/QueueListener), so
the daemon's event loop never waits on log output: a write to a full pipe, a journal socket that is
behind, or a disk busy flushing would otherwise stall every request for as long as it blocks.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
from logging.handlers import QueueHandler, QueueListener

_listener: QueueListener | None = None
_queued: QueueHandler | None = None


def setup(level: str = "INFO") -> None:
    global _listener, _queued
    root = logging.getLogger()
    if getattr(setup, "_done", False):
        root.setLevel(level)
        return
    from appliance.runtime.systemd import journal_handler, under_systemd

    handler = journal_handler() if under_systemd() else None
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = QueueListener(records, handler, respect_handler_level=True)
    _listener.start()
    atexit.register(shutdown)
    _queued = QueueHandler(records)
    root.addHandler(_queued)
    root.setLevel(level)
    # uvicorn's per-request access log would duplicate the appliance's request log.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # httpx logs every upstream call at INFO; the request log already has them.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    setup._done = True  # type: ignore[attr-defined]


def shutdown() -> None:
    """Write what is still queued, stop the writer thread, and write directly from then on (at exit)."""
    global _listener, _queued
    if _listener is None or _queued is None:
        return
    root = logging.getLogger()
    root.removeHandler(_queued)
    _listener.stop()  # drains the queue first
    for handler in _listener.handlers:
        root.addHandler(handler)
    _listener = _queued = None
