"""A fuzz campaign against a running appliance, and what it must never see (issue 15's done-when).

Probes are drawn from the Hypothesis strategies in tests/fuzz/requests.py (a seed makes a run repeatable),
sent `concurrency` at a time, and every answer is checked:

* no 5xx but a 503 with Retry-After (a refusal, not a fault); no 500 at all;
* every 4xx/5xx an OpenAI error body (JSON object `error` with a message and a type), or Anthropic's
  (`{"type": "error", "error": {"type", "message"}}`) on the Messages routes;
* every 200 a whole answer: JSON with choices (output for a response, content for a message), or an event
  stream that ends with [DONE] and no error event (response.completed, message_stop for those APIs);
* an ordinary request is answered 200, or refused with 429/503 (admission under load), never with a 4xx;
* no request left unanswered past its deadline (the configured timeouts plus generation time);
* every request the gateway answered on a generation route has its row in the request log, with that status;
* afterwards: the engine never restarted, the daemon logged no traceback, and its memory stayed flat.

The test (tests/integration/test_fuzz.py) runs a bounded budget; bench/fuzz.py runs the long one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests import loopback
from tests.fuzz import isolated
from tests.fuzz.requests import ANTHROPIC_ROUTES, Probe

REQUEST_ID_HEADER = "x-request-id"


def draw_probes(count: int, run_seed: int, served: str, max_tokens: int, max_choices: int,
                max_body_bytes: int) -> list[Probe]:
    """`count` probes, the same ones for the same seed wherever they are drawn (tests.fuzz.isolated)."""
    return isolated.drawn("tests.fuzz.requests:generate", count, run_seed, served, max_tokens, max_choices, max_body_bytes)


@dataclass
class Outcome:
    probe: Probe
    sent_id: str
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    seconds: float = 0.0
    failure: str | None = None  # no answer: why


async def _send(client: httpx.AsyncClient, probe: Probe, sent_id: str, timeout: float) -> Outcome:
    out = Outcome(probe, sent_id)
    # A header value that is not ASCII goes as UTF-8 bytes, as a hostile client would send it.
    headers = [(k.encode(), v.encode("utf-8", "surrogatepass")) for k, v in probe.headers]
    if not any(k.lower() == REQUEST_ID_HEADER.encode() for k, _ in headers):
        headers.append((REQUEST_ID_HEADER.encode(), sent_id.encode()))
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            r = await client.request(probe.method, probe.path, content=probe.body or None, headers=headers)
        out.status, out.headers, out.body = r.status_code, dict(r.headers), r.content
    except TimeoutError:
        out.failure = f"no answer within {timeout:g}s"
    except httpx.HTTPError as e:
        out.failure = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


async def send_all(base_url: str, drawn: Iterable[Probe], concurrency: int, timeout: float,
                   tag: str, progress=None) -> list[Outcome]:
    queue: asyncio.Queue[tuple[int, Probe]] = asyncio.Queue()
    for i, p in enumerate(drawn):
        queue.put_nowait((i, p))
    results: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with loopback.async_client(base_url=base_url, limits=limits, timeout=None) as client:

        async def worker() -> None:
            while not queue.empty():
                i, p = queue.get_nowait()
                results.append(await _send(client, p, f"fuzz-{tag}-{i}", timeout))
                if progress is not None:
                    progress(len(results))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def _error_body_problem(out: Outcome) -> str | None:
    if "application/json" not in out.headers.get("content-type", ""):
        return f"content-type {out.headers.get('content-type')!r}, not JSON"
    if out.probe.path.split("?")[0] in ANTHROPIC_ROUTES:
        return _anthropic_error_problem(out)
    try:
        body = json.loads(out.body)
        err = body["error"]
        assert isinstance(err, dict) and isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and err["type"]
        assert err.get("code") is None or isinstance(err["code"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"not an OpenAI error body: {out.body[:200]!r}"
    return None


# The event a whole stream of these APIs ends with (a response cut short by its output limit ends
# "incomplete", which is whole too)
_STREAM_ENDS = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}


def _anthropic_error_problem(out: Outcome) -> str | None:
    """Anthropic's error shape on its routes: {"type": "error", "error": {"type", "message"}}."""
    try:
        body = json.loads(out.body)
        assert body["type"] == "error" and isinstance(body["error"]["type"], str) and body["error"]["type"]
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"not an Anthropic error body: {out.body[:200]!r}"
    return None


def _engine_fault(event: str) -> bool:
    """An error event for vLLM's own failure mid-stream (its handler raised: type InternalServerError),
    after the appliance had checked the request and the engine had accepted it. The appliance relays it
    as the OpenAI error event it is; the campaign counts these apart (Report.engine_faults), since they
    are the engine's defects, not the appliance's. (One seen: vLLM 0.32, a streamed completion with echo
    and logprobs on a token-id prompt, KeyError in _create_completion_logprobs.)"""
    try:
        err = json.loads(event)["error"]
        return err.get("type") == "InternalServerError" and bool(err.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def engine_faults(outcomes: list[Outcome]) -> list[str]:
    found = []
    for out in outcomes:
        if out.status == 200 and "text/event-stream" in out.headers.get("content-type", ""):
            text = out.body.decode("utf-8", "replace")
            for line in text.split("\n"):  # SSE's lines; splitlines() would also cut at \x1c or \u2028 in the data
                if line.startswith('data: {"error"') and _engine_fault(line[6:]):
                    found.append(f"{line[6:300]} <- [{out.probe.note}] {out.probe.reproduce()}")
    return found


def _answer_problem(out: Outcome) -> str | None:
    """A 200 that is not a whole answer."""
    if out.probe.method == "HEAD":
        return None
    ctype = out.headers.get("content-type", "")
    if "text/event-stream" in ctype:
        # SSE's lines end in \n only: splitlines() would also cut a data line at a \x1c or \u2028 the answer
        # echoes (a Responses stream repeats the request's instructions in its events)
        events = [line[6:] for line in out.body.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
        endings = _STREAM_ENDS.get(out.probe.path)
        if endings is not None:  # the Responses and Messages streams end with an event of their own
            if not events or not any(f'"type":"{e}"' in events[-1] for e in endings):
                return f"stream did not end with {' or '.join(endings)}: {out.body[-200:]!r}"
            return None
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {out.body[-200:]!r}"
        errors = [e for e in events if e.startswith('{"error"')]
        if errors and not all(_engine_fault(e) for e in errors):
            return f"stream carried an error event: {out.body[-300:]!r}"
        return None
    if out.probe.generation:
        try:
            answer = json.loads(out.body)
            field = {"/v1/responses": "output", "/v1/messages": "content"}.get(out.probe.path, "choices")
            if not isinstance(answer.get(field), list):
                return f"no {field}"
        except ValueError:
            return f"200 with a body that is not JSON: {out.body[:200]!r}"
    return None


def check_answers(outcomes: list[Outcome]) -> list[str]:
    problems: list[str] = []
    for out in outcomes:
        p = out.probe
        where = f"[{p.note}] {p.reproduce()}"
        if out.failure is not None:
            problems.append(f"no answer ({out.failure}) after {out.seconds:.1f}s: {where}")
            continue
        assert out.status is not None
        if out.status >= 500 and not (out.status == 503 and "retry-after" in out.headers):
            problems.append(f"{out.status} {out.body[:300]!r}: {where}")
        if out.status >= 400 and p.method != "HEAD":  # a HEAD answer has no body, by HTTP's rules
            bad = _error_body_problem(out)
            if bad:
                problems.append(f"{out.status} with {bad}: {where}")
        elif out.status == 200:
            bad = _answer_problem(out)
            if bad:
                problems.append(f"200 but {bad}: {where}")
        if p.well_formed and out.status not in (200, 429, 503):
            problems.append(f"an ordinary request got {out.status} {out.body[:300]!r}: {where}")
    return problems


def _reached_the_gateway(out: Outcome) -> bool:
    """A generation request the gateway itself answered (the key middleware's 401 comes before it)."""
    return out.probe.generation and out.status is not None and out.status != 401


def check_rows(outcomes: list[Outcome], database: Path, wait_s: float = 10.0) -> list[str]:
    """Every generation request the gateway answered has its row, with the status the client saw."""
    wanted: dict[str, Outcome] = {}
    problems = []
    for out in outcomes:
        if not _reached_the_gateway(out):
            continue
        rid = out.headers.get(REQUEST_ID_HEADER)
        if not rid:
            problems.append(f"{out.status} without X-Request-Id: [{out.probe.note}] {out.probe.reproduce()}")
            continue
        wanted[rid] = out
    found: dict[str, int] = {}
    deadline = time.monotonic() + wait_s  # the writer batches; give it time to drain
    while True:
        db = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
        try:
            ids = list(wanted)
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                rows = db.execute(f"SELECT id, status FROM requests WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                found.update(dict(rows.fetchall()))
        finally:
            db.close()
        if len(found) == len(wanted) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for rid, out in wanted.items():
        if rid not in found:
            problems.append(f"request-log row lost: {rid} ({out.status}) [{out.probe.note}] {out.probe.reproduce()}")
        elif found[rid] != out.status:
            problems.append(f"request-log row {rid} says {found[rid]}, the client got {out.status}")
    return problems


def daemon_tracebacks(log_text: str) -> list[int]:
    """Where the daemon's own tracebacks start in its log. The engine's output is in the same file, each
    line under `appliance.engine.vllm:`; a traceback of vLLM's own is vLLM's business (an engine that
    died of it shows as a restart), so only a line that begins with one counts."""
    return [m.start() for m in re.finditer(r"^Traceback \(most recent call last\)", log_text, re.M)]


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@dataclass
class Report:
    seed: int
    drawn: str  # a digest of the probes the seed drew: a rerun with the seed shows the same
    outcomes: list[Outcome]
    problems: list[str]
    rss: list[tuple[int, float]]  # (requests sent so far, daemon RSS MiB)
    seconds: float

    def statuses(self) -> Counter:
        return Counter(out.status if out.status is not None else "none" for out in self.outcomes)

    def summary(self) -> str:
        codes: Counter = Counter()
        for out in self.outcomes:
            if out.status and out.status >= 400:
                try:
                    codes[f"{out.status} {json.loads(out.body)['error'].get('code')}"] += 1
                except (ValueError, KeyError, TypeError, AttributeError):
                    codes[f"{out.status} ?"] += 1
        rss = ", ".join(f"{n}: {m:.1f}" for n, m in self.rss)
        faults = engine_faults(self.outcomes)
        shown = "".join(f"\n  {f[:600]}" for f in faults[:5])
        return (f"seed {self.seed} (probes {self.drawn}): {len(self.outcomes)} requests in {self.seconds:.0f}s, "
                f"{len(self.problems)} problems\n"
                f"statuses: {dict(sorted(self.statuses().items(), key=str))}\n"
                f"error codes: {dict(codes.most_common())}\n"
                f"daemon RSS MiB by requests sent: {rss}\n"
                f"engine faults relayed mid-stream (vLLM's own, not counted as problems): {len(faults)}{shown}")


@dataclass(frozen=True)
class Limits:
    """The fuzzed appliance's configuration, which the probes are drawn to match: short timeouts so a stalled
    client costs seconds, a small class token limit so a CPU engine keeps up with the ordinary requests."""
    max_tokens: int = 8
    max_choices: int = 4
    max_body_bytes: int = 65536
    header_timeout_s: float = 2.0
    body_timeout_s: float = 3.0

    def server_toml(self) -> str:
        return (f"max_body_bytes = {self.max_body_bytes}\nmax_choices = {self.max_choices}\n"
                f"header_timeout_s = {self.header_timeout_s}\nbody_timeout_s = {self.body_timeout_s}\n")

    def admission_toml(self) -> str:
        # Anonymous loopback requests are bronze, whose max_tokens bounds what the engine generates.
        return (f'[admission]\nanonymous_class = "bronze"\n\n'
                f"[admission.classes.bronze]\nmax_tokens = {self.max_tokens}\nttft_target_s = 60\nqueue_limit = 64\n")


def _engine_status(base_url: str) -> dict:
    return loopback.get(f"{base_url}/readyz", timeout=10).json()["engine"]


def run_campaign(app, count: int, run_seed: int, limits: Limits, concurrency: int = 8,
                 samples: int = 5, progress=None) -> Report:
    """`count` probes against the running appliance `app` (tests.support.RunningAppliance) configured with
    `limits`; the daemon's memory is sampled after each of `samples` equal slices (the first is warm-up)."""
    t0 = time.monotonic()
    drawn = draw_probes(count, run_seed, app.served_name, limits.max_tokens, limits.max_choices,
                        limits.max_body_bytes)
    log_from = len(app.log_text())
    restarts_before = _engine_status(app.url)["restarts"]
    # Generation time on a busy CPU engine, plus the body deadline a truncated upload waits out.
    timeout = limits.header_timeout_s + limits.body_timeout_s + 90
    outcomes: list[Outcome] = []
    rss: list[tuple[int, float]] = []
    step = max(1, -(-len(drawn) // samples))
    for i in range(0, len(drawn), step):
        done = len(outcomes)
        outcomes += asyncio.run(send_all(app.url, drawn[i:i + step], concurrency, timeout, f"{run_seed}-{i}",
                                         None if progress is None else (lambda n, d=done: progress(d + n))))
        rss.append((len(outcomes), rss_mib(app.proc.pid)))
    problems = check_answers(outcomes) + check_rows(outcomes, app.database)
    status = _engine_status(app.url)
    if status["restarts"] != restarts_before or status["state"] != "ready":
        problems.append(f"the engine did not come through: {status}")
    logged = app.log_text()[log_from:]
    tracebacks = daemon_tracebacks(logged)
    if tracebacks:
        at = tracebacks[0]
        problems.append(f"the daemon logged {len(tracebacks)} traceback(s); the first:\n"
                        f"{logged[max(0, at - 300):at + 1500]}")
    digest = hashlib.sha256(repr(drawn).encode()).hexdigest()[:16]
    return Report(run_seed, digest, outcomes, problems, rss, time.monotonic() - t0)
