"""Logging setup: one line per event on stderr (the journal picks stderr up under systemd)."""

from __future__ import annotations

import logging
import sys


def setup(level: str = "INFO") -> None:
    root = logging.getLogger()
    if getattr(setup, "_done", False):
        root.setLevel(level)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    # uvicorn's per-request access log would duplicate the appliance's request log.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # httpx logs every upstream call at INFO; the request log already has them.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    setup._done = True  # type: ignore[attr-defined]
