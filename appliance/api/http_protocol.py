"""The HTTP/1.1 connection layer: uvicorn's httptools protocol with what an exposed server needs and
uvicorn does not do.

- A header deadline: uvicorn arms no timer before a request's headers are complete, so a connection
  that opens and sends nothing, or sends its headers a byte at a time, stays open forever; enough of
  them exhaust the daemon's file descriptors (issue 15). Past `header_timeout_s`: 408, closed.
- A body deadline: the same for a body sent slower than `body_timeout_s` allows. The request the
  application is serving sees the client leave (`BODY_TIMED_OUT` in its scope state says why).
- A connection cap: past `max_connections` a new connection gets 503 with Retry-After and is closed,
  before it costs a request task. (uvicorn's own limit_concurrency answers text/plain, after parsing.)
- Every refusal at this layer, malformed framing included, is an OpenAI-style JSON error body rather
  than uvicorn's text/plain, so a client's error handling sees the same shape everywhere.
- A refusal lingers, as nginx's does: the answer, then FIN, then what the client still sends is read and
  dropped for up to LINGER_S. Closed at once, a client still sending met a reset, and a reset makes the
  client's kernel throw the unread answer away: it saw "connection reset" instead of the 400.

- A `ClientWriter` in each request's scope (`scope["extensions"][CLIENT_WRITER]`): the connection, for a
  response body written without ASGI's send per chunk (appliance.api.splice says why).

A subclass, not a fork: only the hooks named below are overridden, each calling uvicorn's own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.api.errors import error_body

BODY_TIMED_OUT = "body_timed_out"  # set in the request's scope state when the body deadline passed

LINGER_S = 2.0

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}


def refusal(status: int, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with an OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(error_body(message, kind, None, code)).encode()
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status]), b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    if retry_after_s is not None:
        head.append(b"retry-after: %d" % retry_after_s)
    return b"\r\n".join(head) + b"\r\n\r\n" + body


CLIENT_WRITER = "appliance.client_writer"  # the scope extension holding the request's ClientWriter


class ClientWriter:
    """A request's connection, for the body of a response its ASGI send has started: each write framed as
    HTTP/1.1 chunked, as uvicorn's send frames it, and nothing else of send's bookkeeping per chunk (the
    response's end still goes through send). Reads uvicorn's RequestResponseCycle, whose fields are the
    ones its own send uses."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    @property
    def framed(self) -> bool:
        """Started, chunked and not yet complete: what write() assumes."""
        c = self._cycle
        return bool(c.response_started and c.chunked_encoding and not c.response_complete)

    @property
    def gone(self) -> bool:
        return bool(self._cycle.disconnected)

    @property
    def paused(self) -> bool:
        """The connection's buffer is full: the client reads slower than it is written to."""
        return bool(self._cycle.flow.write_paused)

    async def drain(self) -> None:
        await self._cycle.flow.drain()

    async def flush(self) -> None:
        """Nothing to wait for: each write went to the connection's transport at once."""

    def write(self, data: bytes) -> bool:
        """Send `data` as one chunk; False when the client has gone (nothing is written then). Empty data
        writes nothing: an empty chunk would end the body."""
        c = self._cycle
        if c.disconnected:
            return False
        if not data:
            return True
        c.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True


class GuardedHttpProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024
    retry_after_s: int = 5

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False

    @classmethod
    def configured(cls, *, header_timeout_s: float, body_timeout_s: float, max_connections: int,
                   retry_after_s: int) -> type[GuardedHttpProtocol]:
        """The class uvicorn instantiates per connection, carrying this server's limits."""
        return type("GuardedHttpProtocol", (cls,), {
            "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
            "max_connections": max_connections, "retry_after_s": retry_after_s})

    # -- uvicorn's hooks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            # Closed at once, no linger: past the cap, file descriptors are what is short.
            self._refuse(503, f"the appliance has {self.max_connections} connections open, its limit; retry "
                              "later", "too_many_connections", self.retry_after_s, linger=False)
            return
        self._arm(self.header_timeout_s, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering after a refusal: the rest of what the client sends is dropped
            return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a keep-alive connection's next request
            self._arm(self.header_timeout_s, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # its task is created, not yet run
            # (an upgrade request makes no cycle: self.cycle is then the previous request's)
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[CLIENT_WRITER] = ClientWriter(self.cycle)
        if self.cycle is not None and self.cycle.more_body:
            self._arm(self.body_timeout_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"malformed HTTP request: {msg}", "bad_http_request")

    # -- ours -----------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _refuse(self, status: int, message: str, code: str, retry_after_s: int | None = None,
                linger: bool = True) -> None:
        self._disarm()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A request on this connection is still being served (the refusal is for what came after
            # it, or for its own body): it ends with the connection, as for a client that left, so its
            # answer is not written after the refusal's FIN.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # mid-answer: a refusal now would be garbage inside that answer
                self.transport.close()
                return
        self.transport.write(refusal(status, message, code, retry_after_s))
        if not linger or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the answer, then FIN; the client's close (or the linger) ends it
        self._arm(LINGER_S, self.transport.close)

    def _headers_too_slow(self) -> None:
        self._deadline = None
        self._refuse(408, f"the request's headers did not arrive within {self.header_timeout_s:g}s",
                     "header_timeout")

    def _body_too_slow(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_started:
            return
        # The application is waiting for the rest of the body: it sees the client leave, and the scope
        # says why, so the request log can say 408 rather than "client disconnected".
        self.scope["state"][BODY_TIMED_OUT] = True
        self._refuse(408, f"the request body did not arrive within {self.body_timeout_s:g}s", "body_timeout")
