"""Prometheus metrics at /metrics (prometheus-client): the gateway's own figures, and the engine's key
figures re-exported from its private port (which is not reachable from outside the box).

The engine's figures come from the engine watch's last poll (every 2 s), not from a call to the engine
per scrape: a scrape must answer at once whatever the engine is doing, and the engine is read once."""

from __future__ import annotations

import collections
import logging
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from appliance.api.admission import Load
from appliance.engine.supervisor import EngineState, EngineStatus
from appliance.engine.watch import lines_for
from appliance.ops.doctor import Finding
from appliance.ops.traffic import ESCALATION_OUTCOMES, TrafficSample
from appliance.store.requests import RequestRecord

log = logging.getLogger(__name__)

# The engine families worth a fleet operator's dashboard (docs/engine-notes.md lists them all).
ENGINE_FAMILIES = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
    "vllm:cache_config_info",
})
_ENGINE_PREFIXES = tuple(ENGINE_FAMILIES)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)


class _EngineFamilies:
    """A collector that yields the dashboard's families from the engine's last /metrics text."""

    def __init__(self) -> None:
        self.source: Callable[[], str | None] = lambda: None

    def collect(self) -> Iterable[Metric]:
        text = self.source()
        if not text:
            return []
        try:
            return [f for f in text_string_to_metric_families(lines_for(text, _ENGINE_PREFIXES))
                    if f.name in ENGINE_FAMILIES]
        except ValueError as e:  # the engine wrote something the parser does not take: skip, do not fail the scrape
            log.debug("engine metrics unreadable: %s", e)
            return []


class _CascadeFigures:
    """Read from the cascade at scrape time: its counters live there, the outbox in SQLite."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterable[Metric]:
        st = self.status()
        req = CounterMetricFamily("appliance_cascade_requests", "Requests by cascade outcome: local, escalated "
                                  "(answered regionally), queued, fallback (sync escalation answered locally), "
                                  "failed, outbox_full", labels=["outcome"])
        for outcome, n in sorted(st["requests"].items()):
            req.add_metric([outcome], n)
        yield req
        box = st["outbox"]
        depth = GaugeMetricFamily("appliance_outbox_escalations", "Escalations in the outbox by status",
                                  labels=["status"])
        for status, n in box["counts"].items():
            depth.add_metric([status], n)
        yield depth
        yield GaugeMetricFamily("appliance_outbox_oldest_age_seconds", "Age of the oldest waiting escalation",
                                value=box["oldest_age_s"])
        link = st["link"]
        yield GaugeMetricFamily("appliance_regional_link_up", "1 when the last call over the backhaul worked",
                                value=1.0 if link.get("up") else 0.0)
        breaker = GaugeMetricFamily("appliance_regional_breaker_state", "1 for the breaker's current state",
                                    labels=["state"])
        for state in ("closed", "open", "half_open"):
            breaker.add_metric([state], 1.0 if link.get("breaker") == state else 0.0)
        yield breaker
        yield from _budget_figures(st.get("budget") or [])


def _budget_figures(budgets: list[dict[str, Any]]) -> Iterable[Metric]:
    """The escalation budget per route and tenant: its target, the share it held, the threshold in force."""
    names = ("appliance_escalation_budget_target", "appliance_escalation_budget_share",
             "appliance_escalation_budget_threshold")
    helps = ("Share of judged answers the budget escalates", "Share of the window's judged answers escalated",
             "quantile_logprob threshold in force (absent while the budget warms up)")
    families = [GaugeMetricFamily(n, h, labels=["route", "tenant"]) for n, h in zip(names, helps, strict=True)]
    for b in budgets:
        labels = [b["route"], b["tenant"] or ""]
        for family, value in zip(families, (b["target"], b["share"], b["threshold"]), strict=True):
            if value is not None:
                family.add_metric(labels, value)
    yield from families


class _DoctorFindings:
    """The doctor's live findings at scrape time: one series per check and status, 1 for the status it
    has now, so an alert rule can wait on `{check="kv-pressure",status="warn"} == 1` for a while."""

    STATUSES = ("ok", "warn", "fail", "skip")

    def __init__(self, findings: Callable[[], Sequence[Finding]]) -> None:
        self.findings = findings

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily("appliance_doctor_finding", "The doctor's live findings (GET "
                                   "/v1/appliance/doctor): 1 for each check's status now", labels=["check", "status"])
        for f in self.findings():
            for status in self.STATUSES:
                family.add_metric([f.check, status], 1.0 if f.status == status else 0.0)
        yield family


class _StateDisk:
    """The file system under the state directory (request log, keys, outbox): read at scrape time."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterable[Metric]:
        where = self.directory
        while not where.exists() and where != where.parent:  # not made yet: the file system it will be on
            where = where.parent
        try:
            usage = shutil.disk_usage(where)
        except OSError:  # unreadable: no figure rather than a failed scrape
            return
        yield GaugeMetricFamily("appliance_state_disk_free_bytes", "Bytes free to the daemon under the state "
                                "directory", value=usage.free)
        yield GaugeMetricFamily("appliance_state_disk_size_bytes", "Size of the file system under the state "
                                "directory", value=usage.total)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("appliance_requests", "Requests by route, status and priority class",
                                ["route", "status", "class"], registry=r)
        self.ttft = Histogram("appliance_time_to_first_token_seconds", "Streamed requests: first token at the gateway",
                              ["route", "class"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("appliance_time_per_output_token_seconds", "Streamed requests: per token after the first",
                              ["route", "class"], buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("appliance_request_duration_seconds", "Whole request at the gateway",
                                  ["route", "class"], buckets=LATENCY_BUCKETS, registry=r)
        self.engine_up = Gauge("appliance_engine_state", "1 for the engine's current state", ["state"], registry=r)
        self.engine_restarts = Counter("appliance_engine_restarts", "Engine restarts by the supervisor", registry=r)
        self.engine_scrape_errors = Counter("appliance_engine_scrape_errors", "Failed polls of the engine's /metrics",
                                            registry=r)
        self.model_info = Gauge("appliance_model_info", "The served model's artifact digest (1 = this one)",
                                ["model", "digest", "matches_pin"], registry=r)
        self.kernels_info = Gauge("appliance_kernels_info", "The kernel lock's digest (1 = this one)",
                                  ["digest", "matches_lock"], registry=r)
        self.engine_info = Gauge("appliance_engine_attention_backend_info", "The attention backend the engine "
                                 "chose (1 = this one)", ["backend"], registry=r)
        self.admission = Counter("appliance_admission_decisions", "Admission decisions by class and reason",
                                 ["class", "decision", "code"], registry=r)
        self.queue_depth = Gauge("appliance_admission_queue_depth", "Requests waiting for an engine slot",
                                 ["class"], registry=r)
        self.in_flight = Gauge("appliance_admission_in_flight", "Requests holding an engine slot", ["class"],
                               registry=r)
        self.holds = Counter("appliance_restart_holds", "Requests held while the engine restarted, by how the hold "
                             "ended: served (the engine came back), timed_out, gave_up (the supervisor did), left "
                             "(the client did), full (server.restart_hold_max held already)", ["class", "outcome"],
                             registry=r)
        self.held = Gauge("appliance_restart_held", "Requests waiting now for the engine to come back", registry=r)
        self.ttft_target = Gauge("appliance_admission_ttft_target_seconds", "Each priority class's time-to-first-"
                                 "token target ([admission.classes.*] ttft_target_s)", ["class"], registry=r)
        self.forwarded = Counter("appliance_outbox_sends", "Forwarder sends by result: delivered, retry, "
                                 "link_down, rejected, gave_up", ["result"], registry=r)
        self.loop_stalls = Histogram("appliance_event_loop_stall_seconds", "Stalls of the daemon's event loop "
                                     "over a second, by length (every request waited that long)",
                                     buckets=(1, 2, 5, 10, 30, 60), registry=r)
        self.doctor_actions = Counter("appliance_doctor_actions", "Changes the daemon made on the doctor's "
                                      "findings, by action", ["action"], registry=r)
        self.faults = Counter("appliance_internal_errors", "Faults of the appliance's own code, answered with a "
                              "500 and logged with a traceback, by route", ["route"], registry=r)
        self.upgrades = Counter("appliance_upgrades", "Upgrades and rollbacks (appliance upgrade|rollback) by kind "
                                "and how they ended: committed, rolled_back, refused, interrupted",
                                ["kind", "result"], registry=r)
        self.version_info = Gauge("appliance_model_version_info", "The committed version (role current) and the "
                                  "one before it (previous): model digest and path, engine interpreter",
                                  ["role", "digest", "path", "engine"], registry=r)
        self._engine = _EngineFamilies()
        r.register(self._engine)
        self._restarts_seen = 0
        # The same counts, plain, where the doctor reads them (prometheus_client's values are not API).
        self.totals: collections.Counter[str] = collections.Counter()

    def observe_request(self, rec: RequestRecord, priority_class: str | None) -> None:
        cls = priority_class or "none"
        self.requests.labels(rec.route, str(rec.status), cls).inc()
        self.totals["finished"] += 1
        if rec.status >= 500:
            self.totals["failed_5xx"] += 1  # what an upgrade's probation judges
        if rec.status == 200:
            self.totals["answered"] += 1
        if cls == "gold":
            self.totals["gold_requests"] += 1
        if rec.total_ms is not None:
            self.duration.labels(rec.route, cls).observe(rec.total_ms / 1000)
        if rec.stream and rec.ttft_ms is not None and rec.status == 200:
            self.ttft.labels(rec.route, cls).observe(rec.ttft_ms / 1000)
            if rec.completion_tokens and rec.completion_tokens > 1 and rec.total_ms is not None:
                per_token = (rec.total_ms - rec.ttft_ms) / 1000 / (rec.completion_tokens - 1)
                self.tpot.labels(rec.route, cls).observe(per_token)

    def observe_fault(self, route: str) -> None:
        self.faults.labels(route).inc()

    def observe_forward(self, result: str) -> None:
        self.forwarded.labels(result).inc()

    def attach_cascade(self, status: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_CascadeFigures(status))

    def observe_decision(self, cls: str, decision: str, code: str) -> None:
        self.admission.labels(cls, decision, code).inc()
        if cls == "gold" and decision == "reject":
            self.totals["gold_refused"] += 1

    def traffic(self, ts: float, cascade_counts: Mapping[str, int]) -> TrafficSample:
        """The totals the doctor's grow advisor windows (appliance.ops.traffic), with the cascade's counts."""
        t = self.totals
        return TrafficSample(ts, answered=t["answered"], gold_requests=t["gold_requests"],
                             gold_refused=t["gold_refused"],
                             escalations=sum(cascade_counts.get(k, 0) for k in ESCALATION_OUTCOMES))

    def observe_admission(self, load: Load, ttft_targets: Mapping[str, float] | None = None) -> None:
        for cls, target in (ttft_targets or {}).items():
            self.ttft_target.labels(cls).set(target)
        for cls, n in load.queued.items():
            self.queue_depth.labels(cls).set(n)
        for cls, n in load.in_flight.items():
            self.in_flight.labels(cls).set(n)

    def observe_engine(self, st: EngineStatus) -> None:
        if st.attention_backend:
            self.engine_info.clear()
            self.engine_info.labels(st.attention_backend).set(1)
        for s in EngineState:
            self.engine_up.labels(s.value).set(1 if s is st.state else 0)
        if st.restarts > self._restarts_seen:
            self.engine_restarts.inc(st.restarts - self._restarts_seen)
            self._restarts_seen = st.restarts

    def attach_engine(self, source: Callable[[], str | None]) -> None:
        """Where the engine's last /metrics text comes from (the engine watch); None while there is none."""
        self._engine.source = source

    def attach_doctor(self, findings: Callable[[], Sequence[Finding]]) -> None:
        self.registry.register(_DoctorFindings(findings))

    def attach_state_dir(self, directory: Path) -> None:
        self.registry.register(_StateDisk(directory))

    def render(self) -> bytes:
        return generate_latest(self.registry)
