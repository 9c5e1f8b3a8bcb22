"""The composition root: every part of the daemon built from the configuration and the plan.

    config + plan -> request log, metrics -> engine supervisor -> admission, cascade -> gateway
                  -> engine watch, remedies, upgrader -> API app -> Daemon

A test hands in its own supervisor here instead of swapping parts afterwards,
so every part that holds one holds the same one.
"""

from __future__ import annotations

from appliance.api.admission import AdmissionGate
from appliance.api.app import create_app
from appliance.api.auth import keys_required
from appliance.api.gateway import Gateway, GatewaySettings
from appliance.boot.config import Config
from appliance.boot.escalation import build_cascade
from appliance.boot.model_pin import ModelCheck
from appliance.boot.planning import SitePlan
from appliance.boot.site_state import SiteState
from appliance.engine.args import engine_settings
from appliance.engine.supervisor import EngineSupervisor
from appliance.engine.watch import EngineWatch
from appliance.ops.metrics import Metrics
from appliance.ops.remedies import Remedies
from appliance.ops.status import doctor_report, live_findings, status
from appliance.ops.traffic import TrafficWatch
from appliance.runtime.daemon import Daemon
from appliance.runtime.loop_monitor import LoopMonitor
from appliance.runtime.systemd import Notifier
from appliance.store.keys import KeyVerifier
from appliance.store.requests import RequestLog, recent_errors
from appliance.upgrade.upgrader import Upgrader
from appliance.upgrade.versions import Outcome, Version
from kernels.lock import KernelCheck
from kvbudget.render import plan_dict
from quantize.build import read_description


def build(cfg: Config, site_plan: SitePlan, model_check: ModelCheck | None = None,
          kernel_check: KernelCheck | None = None, *, supervisor: EngineSupervisor | None = None,
          file_cfg: Config | None = None, recovered: Outcome | None = None) -> Daemon:
    """`cfg` is what the engine runs (the configuration file's, with the box's committed version applied:
    appliance.upgrade.versions); `file_cfg` the file's own, which upgrades are recorded against."""
    state = SiteState(cfg, site_plan, model_check, kernel_check, model_build=read_description(cfg.model.path))
    metrics = Metrics()
    if model_check is not None:
        metrics.model_info.labels(cfg.served_name, model_check.digest, str(model_check.ok).lower()).set(1)
    if kernel_check is not None:
        metrics.kernels_info.labels(kernel_check.digest or "", str(kernel_check.ok).lower()).set(1)
    request_log = RequestLog(cfg.database_path, keep_text=cfg.state.log_prompts)
    settings = engine_settings(cfg, site_plan.plan)
    supervisor = supervisor or EngineSupervisor(cfg, settings.args,
                                                version=model_check.digest if model_check else cfg.model.digest)
    admission = None
    if settings.admission is not None:
        admission = AdmissionGate(settings.admission)
        admission.on_decision = metrics.observe_decision
    cascade = build_cascade(cfg, site_plan.plan.engine.max_model_len, metrics)
    gateway = Gateway(
        supervisor,
        GatewaySettings(served_name=cfg.served_name, max_body_bytes=int(cfg.server.max_body_bytes),
                        retry_after_s=cfg.server.retry_after_s, upstream_timeout_s=cfg.server.upstream_timeout_s,
                        default_class=cfg.admission.anonymous_class, max_choices=cfg.server.max_choices,
                        engine_socket=cfg.engine_socket,
                        auto_tool_choice=site_plan.plan.tools is None or site_plan.plan.tools.auto,
                        restart_hold_s=cfg.server.restart_hold_s, restart_hold_max=cfg.server.restart_hold_max,
                        class_restart_hold_s={name: c.restart_hold_s for name, c in cfg.admission.classes.items()
                                              if c.restart_hold_s is not None},
                        upgrade_hold_s=cfg.upgrade.hold_s),
        request_log, metrics, admission, cascade)
    # Polled only while the engine serves: a loading engine refusing connections is no scrape error.
    watch = EngineWatch(gateway.client, lambda: supervisor.base_url if supervisor.ready else None,
                        on_error=metrics.engine_scrape_errors.inc)
    metrics.attach_engine(lambda: watch.latest_text)
    if admission is not None:
        gate = admission
        watch.add_listener(lambda s: gate.observe_kv_usage(s.kv_usage))
    # The site's traffic sampled beside each engine sample, for the doctor's grow advisor.
    traffic = TrafficWatch(lambda ts: metrics.traffic(ts, cascade.counts if cascade is not None else {}))
    watch.add_listener(lambda s: traffic.record(s.ts))
    metrics.attach_state_dir(cfg.state.directory)
    upgrader = Upgrader(state, Version.of(file_cfg or cfg), supervisor, gateway, admission, watch, metrics)
    metrics.attach_doctor(lambda: live_findings(state, supervisor, watch, traffic, cascade, upgrader))
    if recovered is not None:
        metrics.upgrades.labels(recovered.kind, recovered.result).inc()
    required = keys_required(cfg.auth.require_keys, cfg.server.host)
    verifier = KeyVerifier(cfg.database_path)
    app = create_app(gateway, plan=lambda: plan_dict(state.site_plan.plan), verifier=verifier,
                     keys_required=required, status=lambda: status(state, supervisor, cascade, upgrader),
                     doctor=lambda: doctor_report(state, supervisor, watch, traffic, cascade, upgrader),
                     recent_errors=lambda: recent_errors(cfg.database_path), upgrader=upgrader)
    return Daemon(state=state, request_log=request_log, metrics=metrics, supervisor=supervisor, admission=admission,
                  cascade=cascade, gateway=gateway, engine_watch=watch,
                  remedies=Remedies(state, supervisor, watch, gateway, admission, metrics), verifier=verifier,
                  keys_required=required, app=app, notifier=Notifier(),
                  loop_monitor=LoopMonitor(on_stall=metrics.loop_stalls.observe))
