"""Builds the cascade (policy, outbox, regional client, forwarder) from the configuration."""

from __future__ import annotations

from collections.abc import Iterable

from appliance.boot.config import Config
from appliance.ops.metrics import Metrics
from cascade.budget import BudgetConfig, Budgets
from cascade.calibrator import Calibrator
from cascade.delivery import RetryPolicy
from cascade.forwarder import Forwarder
from cascade.gateway_headers import GatewayHeaders
from cascade.outbox import Outbox
from cascade.policy import PolicyConfig, TenantPolicy, Thresholds
from cascade.regional import RegionalClient, RegionalSettings, read_secret
from cascade.service import Cascade
from cascade.webhooks import Hook, WebhookSender

OUTBOX_FILE = "outbox.db"


def policy_config(cfg: Config, local_context: int) -> PolicyConfig:
    p, t = cfg.policy, cfg.policy.thresholds
    return PolicyConfig(
        regional_enabled=cfg.regional.enabled,
        default=p.escalate,
        mode=p.mode,
        thresholds=Thresholds(mean_logprob=t.mean_logprob, min_logprob=t.min_logprob,
                              quantile_logprob=t.quantile_logprob, neg_mean_entropy=t.neg_mean_entropy),
        tenants={name: TenantPolicy(tp.escalate, tp.mode, tp.local_only) for name, tp in p.tenants.items()},
        local_model=cfg.served_name,
        regional_model=cfg.regional.model,
        regional_models=frozenset(cfg.regional.models),
        local_context=local_context,
    )


def regional_settings(cfg: Config) -> RegionalSettings:
    r = cfg.regional
    return RegionalSettings(
        base_url=r.base_url, model=r.model, token_file=r.token_file, ca_bundle=r.ca_bundle,
        client_cert=r.client_cert, client_key=r.client_key, connect_timeout_s=r.connect_timeout_s,
        read_timeout_s=r.read_timeout_s, retries=r.retries, breaker_failures=r.breaker_failures,
        breaker_reset_s=r.breaker_reset_s, breaker_max_reset_s=r.breaker_max_reset_s,
        gateway=gateway_headers(cfg) if r.llm_d_headers else None,
    )


def gateway_headers(cfg: Config) -> GatewayHeaders:
    r = cfg.regional
    return GatewayHeaders(
        objectives={str(k): v for k, v in r.objectives.items()}, fairness_id=r.fairness_id, site=cfg.site.name,
        ttft_ms={cls: round(c.ttft_target_s * 1000) for cls, c in cfg.admission.classes.items()},
        tpot_ms={str(k): v for k, v in r.tpot_slo_ms.items()},
    )


def open_outbox(cfg: Config, webhook_tenants: Iterable[str | None] = ()) -> Outbox:
    return Outbox(cfg.state.directory / OUTBOX_FILE, max_pending=cfg.policy.outbox_max_pending,
                  max_age_s=cfg.policy.outbox_max_age_s, keep_label_text=cfg.state.log_prompts,
                  webhook_tenants=webhook_tenants)


def webhooks(cfg: Config) -> dict[str | None, Hook]:
    """Tenant -> its webhook (None: the default for the others), secrets read from their private files."""
    p = cfg.policy
    out: dict[str | None, Hook] = {}
    for tenant, url, secret in [(None, p.webhook_url, p.webhook_secret_file),
                                *((n, t.webhook_url, t.webhook_secret_file) for n, t in p.tenants.items())]:
        if url is not None and secret is not None:
            where = "policy" if tenant is None else f"policy.tenants.{tenant}"
            out[tenant] = Hook(url, read_secret(secret, f"{where}.webhook_secret_file").encode())
    return out


def budgets(cfg: Config) -> Budgets:
    """The escalation budget from [policy] escalation_share and each tenant's own (cascade.budget)."""
    p = cfg.policy

    def budget(share: float | None) -> BudgetConfig | None:
        return None if share is None else BudgetConfig(share, p.budget_window, min(p.budget_warmup, p.budget_window))

    return Budgets(budget(p.escalation_share),
                   {name: b for name, t in p.tenants.items() if (b := budget(t.escalation_share)) is not None})


def build_cascade(cfg: Config, local_context: int, metrics: Metrics | None = None) -> Cascade | None:
    """None when no regional endpoint is configured: then every request is answered locally, at no cost."""
    if not cfg.regional.enabled:
        return None
    hooks = webhooks(cfg)
    outbox = open_outbox(cfg, hooks)
    client = RegionalClient(regional_settings(cfg))
    retry = RetryPolicy(max_attempts=cfg.regional.max_attempts)
    forwarder = Forwarder(outbox, client, concurrency=cfg.regional.forward_concurrency,
                          poll_s=cfg.regional.forward_poll_s, retry=retry,
                          on_result=metrics.observe_forward if metrics else (lambda outcome: None))
    cascade = Cascade(policy_config(cfg, local_context), outbox, client, forwarder,
                      quantile=cfg.policy.thresholds.quantile, retry=retry, budgets=budgets(cfg),
                      calibrator=Calibrator(cfg.policy.calibrate_min_labels) if cfg.policy.calibrate else None,
                      calibrate_every_s=cfg.policy.calibrate_every_s,
                      webhooks=WebhookSender(outbox, hooks, retry=retry) if hooks else None,
                      shadow_share=cfg.policy.shadow_share)
    if metrics is not None:
        metrics.attach_cascade(cascade.status)
    return cascade
