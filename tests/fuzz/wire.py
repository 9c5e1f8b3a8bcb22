"""Raw-socket fuzzing: broken HTTP framing and slow clients, below what an HTTP client library will send.

A `WireProbe` is the bytes of one connection, cut into pieces sent with pauses between them, and maybe
left unfinished (the client then waits, as a stalled one would). Whatever arrives, the appliance must
answer within its header and body deadlines: a parseable HTTP response (h11 reads it, as a client would),
never a 500, an OpenAI error body on every 4xx/5xx, and never a connection left hanging or closed without
a word.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import h11
from hypothesis import strategies as st

from tests.fuzz import isolated
from tests.fuzz.requests import GENERATION_ROUTES, examples

# Mostly well-formed request lines, so the cases behind them (framing, bodies, stalls) are reached.
METHODS = ("GET", "GET", "POST", "POST", "POST", "PUT", "OPTIONS", "G ET", "", "\x00", "POST\t", "BREW")
TARGETS = ("/healthz", "/v1/models", *GENERATION_ROUTES, "*", "http://elsewhere/v1/models", "/a b", "/\x7f",
           "/" + "x" * 9000, "", "/v1/models?" + "&" * 2000)
VERSIONS = ("HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/9.9", "FOO/1.1", "")
BODY = b'{"model":"smollm2-135m-instruct","prompt":"hi","max_tokens":2}'


@dataclass(frozen=True)
class WireProbe:
    pieces: tuple[bytes, ...]
    pause_s: float  # between pieces
    note: str  # how it was built, a cut-off body or header included (the client then waits, stalled)
    method: str  # what h11 is told was sent, so it reads the answer right (HEAD has no body)

    def reproduce(self) -> str:
        raw = b"".join(self.pieces)
        shown = raw if len(raw) <= 400 else raw[:400] + b"...(" + str(len(raw)).encode() + b" bytes)"
        return f"{self.note}: {shown!r}"


def _headers(draw: st.DrawFn, body: bytes) -> tuple[list[bytes], str]:
    lines = [b"Host: 127.0.0.1", b"Content-Type: application/json"]
    how = draw(st.sampled_from(["length", "length", "chunked", "both", "two_lengths", "bad_length", "no_length",
                                "no_host", "no_colon", "space_in_name", "nul_in_value", "fold", "huge_header",
                                "many_headers", "te_gzip"]))
    length = b"Content-Length: %d" % len(body)
    if how in ("length", "no_colon", "space_in_name", "nul_in_value", "fold", "huge_header", "many_headers"):
        lines.append(length)
    if how == "chunked" or how == "both":
        lines.append(b"Transfer-Encoding: chunked")
        if how == "both":
            lines.append(length)
    if how == "two_lengths":
        lines += [length, b"Content-Length: %d" % (len(body) + 5)]
    if how == "bad_length":
        lines.append(b"Content-Length: " + draw(st.sampled_from([b"-1", b"abc", b"1e3", b"99999999999999999999", b" 5 5"])))
    if how == "no_host":
        lines = [length]
    if how == "no_colon":
        lines.append(b"X-Broken header line")
    if how == "space_in_name":
        lines.append(b"X Bad: 1")
    if how == "nul_in_value":
        lines.append(b"X-Nul: a\x00b")
    if how == "fold":
        lines += [b"X-Folded: a", b" continued"]
    if how == "huge_header":
        lines.append(b"X-Huge: " + b"h" * draw(st.sampled_from([8_000, 70_000, 300_000])))
    if how == "many_headers":
        lines += [b"X-%d: v" % i for i in range(draw(st.sampled_from([100, 2_000])))]
    if how == "te_gzip":
        lines.append(b"Transfer-Encoding: gzip")
    return lines, how


def _body(draw: st.DrawFn, framing: str) -> tuple[bytes, str]:
    """The body bytes as the framing would carry them, and what was done to them."""
    if framing in ("chunked", "both"):
        shape = draw(st.sampled_from(["good", "bad_size", "no_end", "no_crlf"]))
        if shape == "good":
            return b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY), "chunks"
        if shape == "bad_size":
            return b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", "bad chunk size"
        if shape == "no_crlf":
            return b"%x\r\n%s0\r\n\r\n" % (len(BODY), BODY), "chunk without CRLF"
        return b"%x\r\n%s\r\n" % (len(BODY), BODY), "last chunk never sent"
    cut = draw(st.sampled_from(["whole", "whole", "short", "extra"]))
    if cut == "short":
        return BODY[: draw(st.integers(0, len(BODY) - 1))], "body cut short"
    if cut == "extra":
        return BODY + b"GARBAGE / HTTP/1.1\r\n\r\n", "garbage after the body"
    return BODY, "body"


@st.composite
def wire_probes(draw: st.DrawFn) -> WireProbe:
    method = draw(st.sampled_from(METHODS))
    line = f"{method} {draw(st.sampled_from(TARGETS))} {draw(st.sampled_from(VERSIONS))}".encode("latin-1")
    headers, framing = _headers(draw, BODY)
    body, shape = _body(draw, framing)
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    raw = line + eol + eol.join(headers) + eol + eol + body
    stop = draw(st.sampled_from(["all", "all", "all", "headers_cut"]))
    if stop == "headers_cut":  # the headers never end: the header deadline's case
        raw = raw[: draw(st.integers(0, len(line) + 20))]
    n = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), min_size=n - 1, max_size=n - 1)))
    pieces = tuple(raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True))
    pause = draw(st.sampled_from([0.0, 0.0, 0.2, 0.6]))
    h11_method = method if method in ("GET", "POST", "PUT", "OPTIONS") else "GET"
    return WireProbe(pieces, pause, f"{framing}, {shape}, {stop}, {n} piece(s), {pause}s apart", h11_method)


def draw_wire_probes(count: int, run_seed: int) -> list[WireProbe]:
    """`count` probes, the same ones for the same seed wherever they are drawn (tests.fuzz.isolated)."""
    return isolated.drawn("tests.fuzz.wire:generate", count, run_seed)


def generate(count: int, run_seed: int) -> list[WireProbe]:
    return examples(wire_probes(), count, run_seed)


def _read_first_response(data: bytes, method: str) -> tuple[int, dict[str, str], bytes] | None:
    """The first whole response in `data`, as a client would read it; None while it is incomplete.
    Raises h11.RemoteProtocolError for bytes that are not HTTP."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    status, headers, body = 0, {}, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED:
            return None
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, body
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def probe_once(port: int, p: WireProbe, deadline_s: float) -> str | None:
    """What is wrong with the appliance's answer to `p`, or None."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        return f"could not connect: {e}"
    received = b""
    try:
        for i, piece in enumerate(p.pieces):
            if i and p.pause_s:
                await asyncio.sleep(p.pause_s)
            writer.write(piece)
            try:
                await writer.drain()
            except OSError:  # the server answered and closed while we were still sending: read the answer
                break
        while True:
            left = deadline_s - (time.monotonic() - t0)
            if left <= 0:
                return f"no whole answer within {deadline_s:g}s (got {received[:200]!r})"
            try:
                chunk = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                received += chunk
            try:
                answer = _read_first_response(received, p.method)
            except h11.RemoteProtocolError as e:
                return f"an answer that is not HTTP ({e}): {received[:200]!r}"
            if answer is not None:
                return _answer_problem(*answer, p.method)
            if not chunk:
                return f"the connection closed without an answer (got {received[:200]!r})"
    finally:
        writer.close()


def _answer_problem(status: int, headers: dict[str, str], body: bytes, method: str) -> str | None:
    if status >= 500 and not (status == 503 and "retry-after" in headers):
        return f"{status}: {body[:300]!r}"
    if status >= 400 and method != "HEAD":
        try:
            err = json.loads(body)["error"]
            assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"{status} without an OpenAI error body: {headers.get('content-type')} {body[:200]!r}"
    return None


async def probe_all(port: int, drawn: list[WireProbe], concurrency: int, deadline_s: float) -> list[str]:
    gate = asyncio.Semaphore(concurrency)

    async def one(p: WireProbe) -> str | None:
        async with gate:
            problem = await probe_once(port, p, deadline_s)
            return None if problem is None else f"{problem}  <- {p.reproduce()}"

    return [r for r in await asyncio.gather(*(one(p) for p in drawn)) if r is not None]
