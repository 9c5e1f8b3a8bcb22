"""A short memory of the engine's own metrics: polled from its private port every few seconds.

Admission reads the latest KV usage from it; the doctor reads the trend (TPOT against KV usage,
speculative acceptance, prefix-cache hits, sustained concurrency) over the last minutes. Counters are
kept cumulative as vLLM reports them; `window` turns two samples into rates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# sample name (as vLLM writes it) -> EngineSample field; values are summed over label sets
_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:spec_decode_num_drafts_total": "spec_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_accepted",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:generation_tokens_total": "generation_tokens",
}

_PREFIXES = tuple(_FIELDS)


@dataclass(frozen=True)
class EngineSample:
    ts: float
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    preemptions: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    spec_drafts: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    generation_tokens: float = 0.0


def lines_for(text: str, names: tuple[str, ...]) -> str:
    """The lines of a Prometheus text about metrics whose names start with one of `names` (samples, HELP
    and TYPE): only what is read goes to the parser, since vLLM's text runs to hundreds of histogram
    buckets, and parsing all of it every 2 s was a tenth of the gateway's CPU under load."""
    return "\n".join(line for line in text.splitlines()
                     if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(names))


def parse_sample(text: str, ts: float) -> EngineSample:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(lines_for(text, _PREFIXES)):
        for s in family.samples:
            field = _FIELDS.get(s.name)
            if field is not None:
                values[field] = values.get(field, 0.0) + float(s.value)
    return EngineSample(ts=ts, **values)


@dataclass(frozen=True)
class Window:
    """What happened between two samples: rates and means over the interval."""

    seconds: float
    kv_usage_start: float
    kv_usage_end: float
    mean_running: float
    preemptions: float
    tpot_s: float | None  # mean inter-token latency in the interval
    prefix_hit_rate: float | None
    spec_acceptance: float | None  # accepted / drafted tokens

    @classmethod
    def between(cls, samples: list[EngineSample]) -> Window | None:
        if len(samples) < 2:
            return None
        a, b = samples[0], samples[-1]
        d_itl = b.itl_count - a.itl_count
        d_pq = b.prefix_queries - a.prefix_queries
        d_draft = b.spec_draft_tokens - a.spec_draft_tokens
        return cls(
            seconds=b.ts - a.ts,
            kv_usage_start=a.kv_usage,
            kv_usage_end=b.kv_usage,
            mean_running=sum(s.running for s in samples) / len(samples),
            preemptions=max(0.0, b.preemptions - a.preemptions),
            tpot_s=(b.itl_sum - a.itl_sum) / d_itl if d_itl > 0 else None,
            prefix_hit_rate=(b.prefix_hits - a.prefix_hits) / d_pq if d_pq > 0 else None,
            spec_acceptance=(b.spec_accepted - a.spec_accepted) / d_draft if d_draft > 0 else None,
        )


class EngineWatch:
    def __init__(self, client: httpx.AsyncClient, base_url: Callable[[], str | None], *, interval_s: float = 2.0,
                 keep: int = 900, on_error: Callable[[], None] = lambda: None) -> None:
        self.client = client
        self.base_url = base_url
        self.interval_s = interval_s
        self.on_error = on_error
        self.samples: deque[EngineSample] = deque(maxlen=keep)
        # The engine's whole /metrics text from the last poll that worked, or None when the last one did
        # not: the gateway's /metrics re-exports part of it without calling the engine again.
        self.latest_text: str | None = None
        self._listeners: list[Callable[[EngineSample], None]] = []

    def add_listener(self, fn: Callable[[EngineSample], None]) -> None:
        self._listeners.append(fn)

    @property
    def latest(self) -> EngineSample | None:
        return self.samples[-1] if self.samples else None

    def since(self, seconds: float) -> list[EngineSample]:
        cutoff = time.time() - seconds
        return [s for s in self.samples if s.ts >= cutoff]

    def clear(self) -> None:
        self.samples.clear()

    async def poll_once(self) -> EngineSample | None:
        base = self.base_url()
        if base is None:
            self.latest_text = None
            return None
        try:
            r = await self.client.get(f"{base}/metrics", timeout=max(1.0, self.interval_s))
            r.raise_for_status()
            sample = parse_sample(r.text, time.time())
        except (httpx.HTTPError, ValueError) as e:
            log.debug("engine metrics unavailable: %s", e)
            self.latest_text = None
            self.on_error()
            return None
        self.latest_text = r.text
        self.accept(sample)
        return sample

    def accept(self, sample: EngineSample) -> None:
        """Keep a sample and hand it to the listeners."""
        if self.samples and sample.generation_tokens < self.samples[-1].generation_tokens:
            self.clear()  # a new engine: its counters restarted from zero, and a window across them means nothing
        self.samples.append(sample)
        for fn in self._listeners:
            fn(sample)

    async def run(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        while True:
            await self.poll_once()
            await sleep(self.interval_s)

