"""A circuit breaker for the backhaul: a dead link costs one fast failure, not a timeout per request.

closed     requests go through; `failures` consecutive link failures open it.
open       requests fail at once; after `reset_s` one probe is let through (half-open).
half_open  the probe's outcome closes the breaker or opens it again with the wait doubled (up to
           `max_reset_s`), so a long outage is probed ever more rarely.

Pure: the clock is passed in. Hand-written because the libraries (pybreaker, aiobreaker) wrap calls
and keep their own timing, while the forwarder and the request path need to ask "may I try?" and
report the outcome of calls they make themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass
class CircuitBreaker:
    failures: int = 3
    reset_s: float = 10.0
    max_reset_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    state: State = field(default="closed", init=False)
    _consecutive: int = field(default=0, init=False)
    _opened_at: float = field(default=0.0, init=False)
    _wait: float = field(default=0.0, init=False)
    _probing: bool = field(default=False, init=False)

    def allow(self) -> bool:
        """May a call go over the link now? In half-open state only one caller gets True."""
        if self.state == "closed":
            return True
        if self.state == "open" and self.clock() - self._opened_at >= self._wait:
            self.state = "half_open"
            self._probing = False
        if self.state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> None:
        self.state = "closed"
        self._consecutive = 0
        self._wait = 0.0
        self._probing = False

    def failure(self) -> None:
        self._consecutive += 1
        if self.state == "half_open":
            self._open(min(self.max_reset_s, max(self.reset_s, self._wait * 2)))
        elif self.state == "closed" and self._consecutive >= self.failures:
            self._open(self.reset_s)

    def hold(self, seconds: float) -> None:
        """The other side asked for a pause (429/503 with Retry-After): nothing goes over the link for
        `seconds`, then one probe. Not a failure: the link works, and a dead link's doubling does not start."""
        if self.state == "open" and self.retry_in_s >= seconds:
            return
        self._open(seconds)

    def _open(self, wait: float) -> None:
        self.state = "open"
        self._opened_at = self.clock()
        self._wait = wait
        self._probing = False

    @property
    def retry_in_s(self) -> float:
        if self.state != "open":
            return 0.0
        return max(0.0, self._wait - (self.clock() - self._opened_at))
