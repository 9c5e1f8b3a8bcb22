"""Admission control by priority class: admit, queue, or refuse at once with a reason.

A request that would miss its class's TTFT target is refused immediately (429 with Retry-After)
instead of queuing until it times out: a queue that grows past what can be served in time only turns
into tail latency (docs/background.md: SLO-aware admission).

Work-conserving: a class's reserved share is held back only while that class is active (work in flight
or waiting, or within `reserve_memory_s` of its last request); otherwise it is lent to whoever waits, so
one class alone uses every slot. A class that comes back while its lent slots are busy takes them back
at once, over the capacity: the engine runs with that many extra sequences (`headroom_slots`) and with
vLLM's priority scheduling, so the newcomer joins the next engine step and, should the KV cache run
short, vLLM preempts the lowest class's work, not the newcomer's (docs/design/admission.md).

`decide` is pure: a request and a snapshot of the load in, a verdict out. `AdmissionGate` holds the live
state (slots in flight per class, the queues, when each class was last active, moving averages of
service time and prefill speed) and hands freed slots to gold before silver before bronze, first come
first served within a class.

The gateway (`appliance.api.gateway`) takes a ticket before it sends a request to the engine and gives it
back when the answer (or stream) ends; the daemon feeds the engine's KV usage in from its metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cascade.policy import PRIORITY_CLASSES

MIN_PREFILL_SAMPLE = 256  # prompt tokens


@dataclass(frozen=True)
class ClassPolicy:
    ttft_target_s: float
    max_tokens: int | None
    queue_limit: int
    reserved_share: float = 0.0  # of capacity, usable by this class only


@dataclass(frozen=True)
class AdmissionConfig:
    capacity: int  # requests the engine runs at once (the plan's max_num_seqs)
    classes: Mapping[str, ClassPolicy]
    kv_high_water: float = 0.95  # above this KV usage vLLM would preempt: no new admissions
    reserve_memory_s: float = 5.0  # a reserved share stays held this long after its class's last request
    # False: a request predicted (or found, in the queue) to miss its TTFT target is queued all the same,
    # so the prediction can be checked against what then happens (bench/admission_calibration.py).
    refuse_late: bool = True

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")
        unknown = set(self.classes) - set(PRIORITY_CLASSES)
        if unknown:
            raise ValueError(f"unknown classes {sorted(unknown)}; use {', '.join(PRIORITY_CLASSES)}")
        if sum(self.reserved_slots(c) for c in self.classes) > self.capacity:
            raise ValueError("reserved shares add up to more than the capacity")

    def reserved_slots(self, cls: str) -> int:
        return math.floor(self.classes[cls].reserved_share * self.capacity)

    @property
    def headroom_slots(self) -> int:
        """Sequences the engine needs beyond the capacity: every class taking back its lent share at once."""
        return sum(self.reserved_slots(c) for c in self.classes)

    @property
    def engine_max_num_seqs(self) -> int:
        return self.capacity + self.headroom_slots

    @classmethod
    def from_section(cls, section: Any, capacity: int) -> AdmissionConfig:
        """From the configuration's [admission] section; capacity from it or else the plan."""
        return cls(
            capacity=section.capacity or capacity,
            classes={name: ClassPolicy(c.ttft_target_s, c.max_tokens, c.queue_limit, c.reserved_share)
                     for name, c in section.classes.items()},
            kv_high_water=section.kv_high_water,
            reserve_memory_s=section.reserve_memory_s,
            refuse_late=section.refuse_late,
        )


@dataclass(frozen=True)
class Load:
    in_flight: Mapping[str, int]
    queued: Mapping[str, int]
    service_time_s: float  # how long a request holds a slot (moving average)
    prefill_tokens_per_s: float  # moving average
    kv_usage: float = 0.0
    recent: frozenset[str] = frozenset()  # classes active within reserve_memory_s, though idle now


@dataclass(frozen=True)
class Request:
    cls: str
    prompt_tokens: int
    max_tokens: int | None = None
    seqs: int = 1  # n (or best_of): each is a sequence in the engine and takes a slot


@dataclass(frozen=True)
class Verdict:
    action: Literal["admit", "queue", "reject"]
    predicted_ttft_s: float
    status: int = 200
    code: str | None = None
    message: str = ""
    retry_after_s: int | None = None


def is_active(load: Load, cls: str) -> bool:
    return load.in_flight.get(cls, 0) > 0 or load.queued.get(cls, 0) > 0 or cls in load.recent


def held_back(cfg: AdmissionConfig, load: Load, cls: str) -> int:
    """Free slots that other, active classes keep in reserve: the ones `cls` may not borrow."""
    return sum(max(0, cfg.reserved_slots(c) - load.in_flight.get(c, 0))
               for c in cfg.classes if c != cls and is_active(load, c))


def usable_slots(cfg: AdmissionConfig, load: Load, cls: str) -> int:
    """The slots a request of this class can get now: the capacity less what active classes hold back."""
    return cfg.capacity - held_back(cfg, load, cls)


def has_free_slot(cfg: AdmissionConfig, load: Load, cls: str, seqs: int = 1) -> bool:
    """Room for `seqs` more sequences of this class now."""
    in_flight = sum(load.in_flight.values())
    if load.in_flight.get(cls, 0) + seqs <= cfg.reserved_slots(cls):
        # Its own reserve, lent out or not: taken back at once. Over the capacity the engine's headroom
        # runs it, and with the KV cache nearly full vLLM preempts a lower class for it, which is the point.
        lower = PRIORITY_CLASSES[PRIORITY_CLASSES.index(cls) + 1:]
        preemptible = any(load.in_flight.get(c, 0) for c in lower)
        return load.kv_usage < cfg.kv_high_water or preemptible
    if load.kv_usage >= cfg.kv_high_water:
        return False
    return in_flight + seqs <= usable_slots(cfg, load, cls)


def ahead_of(load: Load, cls: str) -> int:
    """Queued requests that will be served before a new one of this class."""
    rank = PRIORITY_CLASSES.index(cls)
    return sum(load.queued.get(c, 0) for c in PRIORITY_CLASSES[: rank + 1])


def decide(cfg: AdmissionConfig, load: Load, req: Request) -> Verdict:
    pol = cfg.classes.get(req.cls)
    if pol is None:
        return Verdict("reject", 0.0, 400, "unknown_priority_class", f"no admission policy for class {req.cls!r}")
    prefill = req.prompt_tokens / load.prefill_tokens_per_s
    if req.max_tokens is not None and pol.max_tokens is not None and req.max_tokens > pol.max_tokens:
        return Verdict("reject", prefill, 400, "max_tokens_over_class_limit",
                       f"max_tokens {req.max_tokens} exceeds the {req.cls} class limit of {pol.max_tokens}")
    if req.seqs > cfg.capacity:
        return Verdict("reject", prefill, 400, "too_many_choices",
                       f"{req.seqs} choices need {req.seqs} of the engine's {cfg.capacity} slots at once")
    position = ahead_of(load, req.cls)
    if position == 0 and has_free_slot(cfg, load, req.cls, req.seqs):
        return Verdict("admit", prefill)
    if load.queued.get(req.cls, 0) >= pol.queue_limit:
        return Verdict("reject", math.inf, 429, "queue_full",
                       f"the {req.cls} queue is full ({pol.queue_limit} waiting)",
                       max(1, math.ceil(load.service_time_s)))
    # Slots free up at about usable / service_time per second; this request waits for position + 1 of them,
    # after those a class took back over the capacity have ended.
    usable = max(1, usable_slots(cfg, load, req.cls))
    over = max(0, sum(load.in_flight.values()) - usable)
    wait = (position + req.seqs + over) * load.service_time_s / usable
    predicted = wait + prefill
    if predicted > pol.ttft_target_s and cfg.refuse_late:
        return Verdict("reject", predicted, 429, "ttft_target_unreachable",
                       f"predicted time to first token {predicted:.2f}s exceeds the {req.cls} target "
                       f"{pol.ttft_target_s:g}s ({position} queued ahead)",
                       max(1, math.ceil(predicted - pol.ttft_target_s)))
    return Verdict("queue", predicted)


class AdmissionRejected(Exception):
    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


@dataclass
class Ticket:
    cls: str
    admitted_at: float
    released: bool = field(default=False)
    seqs: int = 1
    predicted_s: float = 0.0  # admission's predicted time to first token when it decided


class AdmissionGate:
    def __init__(self, cfg: AdmissionConfig, *, service_time_s: float = 2.0, prefill_tokens_per_s: float = 2000.0,
                 clock: Callable[[], float] = time.monotonic, alpha: float = 0.2) -> None:
        self.cfg = cfg
        self.clock = clock
        self.alpha = alpha
        self.service_time_s = service_time_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.kv_usage = 0.0
        self.in_flight: dict[str, int] = {c: 0 for c in cfg.classes}
        self._last_active: dict[str, float] = {}  # class -> when its last request ended
        self._waiters: dict[str, deque[asyncio.Future[Ticket]]] = {c: deque() for c in cfg.classes}
        self._seqs: dict[asyncio.Future[Ticket], int] = {}  # a waiter's sequences, when more than one
        self.on_decision: Callable[[str, str, str], None] = lambda cls, decision, code: None

    def load(self) -> Load:
        now = self.clock()
        recent = frozenset(c for c, t in self._last_active.items() if now - t < self.cfg.reserve_memory_s)
        return Load(dict(self.in_flight), {c: len(q) for c, q in self._waiters.items()}, self.service_time_s,
                    self.prefill_tokens_per_s, self.kv_usage, recent)

    async def acquire(self, req: Request) -> Ticket:
        now = self.admit_now(req)
        return now if isinstance(now, Ticket) else await self.queue(req, now)

    def admit_now(self, req: Request) -> Ticket | Verdict:
        """A slot now, or the verdict to wait in the queue with (`queue`); AdmissionRejected when refused.
        Apart from `acquire` so the common case, a free slot, costs its caller no task to await."""
        verdict = decide(self.cfg, self.load(), req)
        self.on_decision(req.cls, verdict.action, verdict.code or "")
        if verdict.action == "reject":
            raise AdmissionRejected(verdict)
        if verdict.action != "admit":
            return verdict
        ticket = self._take(req.cls, req.seqs)
        ticket.predicted_s = verdict.predicted_ttft_s
        return ticket

    async def queue(self, req: Request, verdict: Verdict) -> Ticket:
        """Wait for a slot as `verdict` (admit_now's) said to."""
        ticket = await self._queue(req)
        ticket.predicted_s = verdict.predicted_ttft_s
        return ticket

    async def _queue(self, req: Request) -> Ticket:
        """Wait in the class's queue for a slot, up to the class's target unless refuse_late is off."""
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._waiters[req.cls].append(fut)
        self._seqs[fut] = req.seqs
        self._wake_when_reserves_lapse()
        budget = self.cfg.classes[req.cls].ttft_target_s - req.prompt_tokens / self.prefill_tokens_per_s
        try:
            # shield: a timeout or a cancelled caller must not cancel a slot handed over at the same moment
            return await asyncio.wait_for(asyncio.shield(fut),
                                          timeout=max(budget, 0.0) if self.cfg.refuse_late else None)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return fut.result()  # a slot arrived at the deadline: keep it
            self._forget(req.cls, fut)
            self.on_decision(req.cls, "reject", "ttft_target_missed_in_queue")
            raise AdmissionRejected(Verdict("reject", math.inf, 429, "ttft_target_missed_in_queue",
                                            f"no slot freed within the {req.cls} TTFT target", 1)) from None
        except asyncio.CancelledError:
            # The client went away while queued: give back a slot it was handed, or leave the queue.
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            else:
                self._forget(req.cls, fut)
            raise

    def _forget(self, cls: str, fut: asyncio.Future[Ticket]) -> None:
        self._seqs.pop(fut, None)
        if fut in self._waiters[cls]:
            self._waiters[cls].remove(fut)
        if not fut.done():
            fut.cancel()

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.in_flight[ticket.cls] -= ticket.seqs
        now = self._last_active[ticket.cls] = self.clock()
        held = now - ticket.admitted_at
        self.service_time_s += self.alpha * (held - self.service_time_s)
        self._dispatch()
        self._wake_when_reserves_lapse()

    def reconfigure(self, cfg: AdmissionConfig) -> None:
        """New settings (the doctor's relaunch on another plan): requests waiting are judged again at once
        against them, as a release would have them judged."""
        self.cfg = cfg
        self._dispatch()
        self._wake_when_reserves_lapse()

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        # Short prompts measure the fixed cost of a step, not prefill speed: they would make every
        # long prompt look hopeless.
        if prompt_tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            self.prefill_tokens_per_s += self.alpha * (prompt_tokens / seconds - self.prefill_tokens_per_s)

    def observe_kv_usage(self, usage: float) -> None:
        self.kv_usage = usage
        self._dispatch()

    def _take(self, cls: str, seqs: int = 1) -> Ticket:
        self.in_flight[cls] += seqs
        return Ticket(cls, self.clock(), seqs=seqs)

    def _wake_when_reserves_lapse(self) -> None:
        """A reserve held only by memory is lent when the memory runs out, which no release or arrival
        marks: look at the queue again then."""
        if not any(self._waiters.values()):
            return
        now = self.clock()
        with contextlib.suppress(RuntimeError):  # no running loop: nobody can be waiting either
            loop = asyncio.get_running_loop()
            for cls, t in self._last_active.items():
                left = t + self.cfg.reserve_memory_s - now
                if left > 0 and self.cfg.reserved_slots(cls) and not self.in_flight[cls]:
                    loop.call_later(left, self._dispatch)

    def _dispatch(self) -> None:
        for cls in PRIORITY_CLASSES:
            queue = self._waiters.get(cls)
            # In order: a request of many choices at the head waits for room for all of them rather than
            # being overtaken for ever by single ones behind it.
            while queue and has_free_slot(self.cfg, self.load(), cls, self._seqs.get(queue[0], 1)):
                fut = queue.popleft()
                seqs = self._seqs.pop(fut, 1)
                if not fut.done():
                    fut.set_result(self._take(cls, seqs))
