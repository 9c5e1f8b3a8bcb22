"""Logging setup: structured journal entries under systemd, one line per event on stderr otherwise."""

from __future__ import annotations

import logging
import sys


def setup(level: str = "INFO") -> None:
    root = logging.getLogger()
    if getattr(setup, "_done", False):
        root.setLevel(level)
        return
    from appliance.systemd import journal_handler, under_systemd

    handler = journal_handler() if under_systemd() else None
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    # uvicorn's per-request access log would duplicate the appliance's request log.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # httpx logs every upstream call at INFO; the request log already has them.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    setup._done = True  # type: ignore[attr-defined]
