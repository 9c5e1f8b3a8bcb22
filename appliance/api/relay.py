"""What every chunk of a local stream goes through on its way to the client (appliance.api.splice moves
the chunks; this decides what they become).

For streams the gateway always asks vLLM for the final usage event, so the request log has token
counts, and removes that event again when the client did not ask for it. Under the auto policy the
stream's log-probabilities are gathered on the way (and hidden when the client did not ask for them),
and the `[DONE]` is held back until the finished answer is judged.

Plain synchronous code over byte chunks: testable without a server or an engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from appliance.api import answers
from appliance.api.dialects import CHAT, Dialect, take_usage
from appliance.api.errors import error_body
from appliance.api.exchange import Exchange
from appliance.store.requests import RequestRecord
from cascade import signals

log = logging.getLogger(__name__)

_USAGE_MARK = b'"usage":{'
_EMPTY_CHOICES = b'"choices":[]'
_DONE = b"data: [DONE]"


@dataclass
class StreamJudge:
    hide: bool  # the client did not ask for log-probabilities: remove them from every chunk
    after: Callable[[signals.TokenLogprobs], Awaitable[bytes]]  # what to add before [DONE], given the answer
    acc: signals.StreamAccumulator = field(default_factory=signals.StreamAccumulator)
    texts: list[str] = field(default_factory=list)  # the answer's text, for the label an escalation makes


def refused_at_start(first: bytes) -> tuple[int, bytes] | None:
    """The status and error body when a stream's first event is an error, else None.

    vLLM checks some requests only once it has answered 200 and begun the stream (a completion prompt
    that tokenizes to nothing: "The decoder prompt cannot be empty"), so the refusal arrives as an SSE
    error event. Seen before the client's headers go out, it can still be the 4xx it is."""
    line = first.lstrip().split(b"\n", 1)[0]
    if not line.startswith(b'data: {"error"'):
        return None
    try:
        err = json.loads(line[6:])["error"]
        code = err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    status = code if isinstance(code, int) and 400 <= code < 500 else 502
    return status, json.dumps({"error": err}).encode()


class EventFilter:
    """Whole events only, the first one's time taken, the usage taken into the request's record (and
    removed when the client did not ask for it), the text kept when the request log keeps texts, the
    log-probabilities handed to the judge and `[DONE]` held back for it. Synchronous: called once per
    chunk."""

    def __init__(self, exchange: Exchange, strip_usage: bool, on_first: Callable[[], None] = lambda: None,
                 judge: StreamJudge | None = None) -> None:
        self.exchange, self.rec, self.t0 = exchange, exchange.rec, exchange.t0
        self.strip_usage, self.on_first, self.judge = strip_usage, on_first, judge
        self.texts: list[str] | None = [] if self.rec.prompt is not None else None
        self._buf = b""
        self._held: bytes | None = None  # a judged stream's end, from its [DONE] on

    def feed(self, chunk: bytes) -> bytes:
        """The whole events `chunk` completes, ready for the client (often b"")."""
        self.exchange.received()
        rec = self.rec
        if rec.ttft_ms is None:
            rec.ttft_ms = (time.perf_counter() - self.t0) * 1000
            self.on_first()
        buf = self._buf + chunk
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._buf = buf
            return b""
        ready, self._buf = buf[: cut + 2], buf[cut + 2 :]
        if _USAGE_MARK in ready or self.texts is not None or self.judge is not None:
            ready = inspect_events(ready, rec, self.strip_usage, self.texts, self.judge, self.exchange.dialect)
        if self.judge is not None:
            if self._held is not None:
                self._held += ready
                return b""
            if _DONE in ready:  # the answer is complete: its end waits for the judge (ending())
                ready, self._held = ready.split(_DONE, 1)
                self._held = _DONE + self._held
        return ready

    async def ending(self) -> bytes:
        """What ends a stream the engine finished whole: for a judged one, what the judge adds (a comment
        naming the escalation) before the held-back `[DONE]`; then what came after the last whole event
        (nothing, from a well-formed stream)."""
        rest, self._buf = self._buf, b""
        if self.judge is None or self._held is None:
            return rest
        return await self.judge.after(self.judge.acc.result()) + self._held + rest

    def broke_off(self, e: BaseException) -> bytes:
        """The engine went away mid-answer: the error event that ends the stream, which the OpenAI client
        raises on, instead of a silent truncation."""
        rec = self.rec
        rec.status, rec.error_code = 502, "engine_stream_broken"
        log.warning("stream %s broke off: %s", rec.id, e or type(e).__name__, extra={"REQUEST_ID": rec.id})
        err = error_body("the engine stopped while streaming this answer; retry", "server_error", None,
                         "engine_stream_broken")
        return b"data: " + json.dumps(err).encode() + b"\n\n"

    def client_left(self) -> None:
        self.rec.status, self.rec.error_code = 499, "client_disconnected"

    def finish(self) -> None:
        if self.texts is not None:
            self.rec.completion = "".join(self.texts)


def inspect_events(ready: bytes, rec: RequestRecord, strip_usage: bool, texts: list[str] | None,
                   judge: StreamJudge | None = None, dialect: Dialect = CHAT) -> bytes:
    """Whole events: usage taken into `rec`, text into `texts`, log-probabilities into the judge. An event
    may name its type on an `event:` line before its data (the Responses and Messages APIs do)."""
    kept: list[bytes] = []
    for event in ready.split(b"\n\n"):
        if not event:
            continue
        at = 0 if event.startswith(b"data: {") else event.find(b"\ndata: {") + 1
        if at > 0 or event.startswith(b"data: {"):
            is_usage = _USAGE_MARK in event
            # vLLM's usage-only event, tested as vLLM wrote it (hiding log-probabilities re-encodes it)
            usage_only = is_usage and strip_usage and _EMPTY_CHOICES in event
            if is_usage or texts is not None or judge is not None:
                with contextlib.suppress(ValueError):
                    data = json.loads(event[at + 6:])
                    if is_usage:
                        take_usage(rec, dialect.usage_of(data))
                    if texts is not None:
                        texts.append(dialect.text_of(data, True))
                    if judge is not None:
                        judge.acc.add_chunk(data)
                        judge.texts.append(dialect.text_of(data, True))
                        if judge.hide:
                            answers.hide_logprobs(data)
                            event = event[:at] + b"data: " + json.dumps(data).encode()
            if usage_only:
                continue
        kept.append(event + b"\n\n")
    return b"".join(kept)
