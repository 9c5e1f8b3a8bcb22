"""The appliance's configuration: one TOML file, validated at start.

The file is found at ``--config PATH``, else ``$APPLIANCE_CONFIG``, else
``/etc/appliance/appliance.toml``. Relative paths inside the file are resolved
against the file's own folder, and ``~`` is expanded, so a config file can be
moved together with the things it points at.

Every section forbids unknown keys: a typo must fail loudly at start, not be
silently ignored on a box nobody watches.
"""

from __future__ import annotations

import logging
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from appliance.boot.net import is_loopback
from cascade.gateway_headers import check_fairness_template
from cascade.policy import Escalate, Mode, PriorityClass
from kvbudget.accounting import KvDtype
from kvbudget.plan_types import SpeculativeTarget, Workload
from kvbudget.weights import WeightTarget

DEFAULT_CONFIG_PATH = Path("/etc/appliance/appliance.toml")
CONFIG_ENV = "APPLIANCE_CONFIG"

Port = Annotated[int, Field(ge=0, le=65535)]
Seconds = Annotated[float, Field(gt=0)]


# How a start-up check acts on a difference from its pin: refuse to start, log it, or skip the check.
Verify = Literal["fail", "warn", "off"]

class ConfigError(Exception):
    """A configuration problem, phrased for an operator."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class SiteSection(_Section):
    """Who this box is: shown in /v1/appliance/status and the metrics, so a fleet can tell sites apart."""

    name: str = Field(default="", max_length=128, description="This site's name, shown in the status and metrics.")


class ModelSection(_Section):
    path: Path = Field(description="Local folder of the HF model (config.json, tokenizer, safetensors).")
    served_name: str = Field(default="", description="Model id clients send; default: the folder name.")
    digest: str = Field(default="", pattern=r"^(sha256:[0-9a-f]{64})?$",
                        description="The pinned artifact digest (`appliance model pin` prints it).")
    verify: Verify = Field(
        default="warn", description="At start: refuse (fail) or log (warn) a model that does not match its pin."
    )

    @field_validator("served_name")
    @classmethod
    def _no_blank_inside(cls, v: str) -> str:
        if v and (v != v.strip() or not v.strip()):
            raise ValueError("must not start or end with whitespace")
        return v


class ServerSection(_Section):
    host: str = Field(default="127.0.0.1",
        description="Listen address; off loopback, API keys are required (auth.require_keys = auto).")
    port: Port = Field(default=8000, description="Listen port of the OpenAI-compatible API.")
    max_body_bytes: ByteSize = Field(default=ByteSize(1 << 20), description="Larger request bodies get 413.")
    retry_after_s: Annotated[int, Field(ge=1, le=3600)] = Field(default=5,
        description="Retry-After on 503 while the engine is not ready.")
    upstream_timeout_s: Seconds = Field(default=600.0, description="Longest a request may wait on the engine.")
    header_timeout_s: Seconds = Field(default=10.0,
        description="A connection whose request headers are not all in by then gets 408 and is closed.")
    body_timeout_s: Seconds = Field(default=60.0,
        description="A request body not all in by then, after its headers, gets 408 and is closed.")
    max_connections: Annotated[int, Field(ge=1)] = Field(default=1024,
        description="Open client connections at most; past it a new one gets 503 with Retry-After.")
    max_choices: Annotated[int, Field(ge=1, le=128)] = Field(default=4,
        description="Largest n (and best_of) a request may ask for; each choice is a sequence in the engine, "
                    "and admission counts it as one.")
    restart_hold_s: Annotated[float, Field(ge=0)] = Field(default=60.0,
        description="While the engine restarts (after a death, or relaunched on purpose), a new request that "
                    "cannot go to the regional tier waits this long for it (per class: admission.classes.*."
                    "restart_hold_s) before 503 with Retry-After; 0: 503 at once. Not during the first start.")
    restart_hold_max: Annotated[int, Field(ge=0)] = Field(default=256,
        description="Requests held at most while the engine restarts; past it, 503 with Retry-After at once.")


class StateSection(_Section):
    directory: Path = Field(default=Path("/var/lib/appliance"),
        description="SQLite database (appliance.db), escalation outbox, engine compile cache.")
    log_prompts: bool = Field(default=False, description="Store prompt and completion text in the request log.")


# A parser name as vLLM's registries spell them (qwen3_coder, llama4_pythonic, openai_gptoss): checked
# for shape here, for existence by vLLM's own argument parser when the plan goes through the probe.
ParserName = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,40}$")]


class EngineSection(_Section):
    python: str = Field(default="", description="Interpreter that has vLLM installed; default: the appliance's own.")
    socket_dir: Path | None = Field(default=None,
        description="Private directory (made 0700) for the engine's Unix socket, its only way in; "
                    "default: <state>/engine. At most 70 bytes long: Unix socket paths are short.")
    kv_cache_memory_bytes: ByteSize | None = Field(
        default=None,
        description="Exact KV pool passed to vLLM; unset: the plan sizes it from the GPU (required without a GPU).",
    )
    max_model_len: Annotated[int, Field(ge=16)] | None = Field(default=None, description="Unset: from the plan.")
    max_num_seqs: Annotated[int, Field(ge=1)] | None = Field(default=None, description="Unset: from the plan.")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(default=0.92,
        description="Share of GPU memory the plan may use, like vLLM's own default.")
    enforce_eager: bool = Field(default=False,
        description="Skip torch.compile and CUDA graphs: faster start, slower decode.")
    tool_call_parser: ParserName = Field(default="auto",
        description="vLLM's --tool-call-parser: \"auto\" chooses it from the model (its family and chat template; "
                    "the plan says what it chose and which tool choices work), \"none\" turns tool calls off, "
                    "or a parser name vLLM knows (checked by vLLM at planning).")
    reasoning_parser: ParserName = Field(default="auto",
        description="vLLM's --reasoning-parser: \"auto\" from the model family, \"none\", or a parser name.")
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to the vLLM command line.")
    cache_dir: Path | None = Field(default=None, description="vLLM compile cache; default: <state>/engine-cache.")
    startup_timeout_s: Seconds = Field(default=900.0,
        description="Longest the engine may take to answer /health after a start.")
    stop_grace_s: Seconds = Field(default=15.0, description="SIGTERM, then SIGKILL after this long.")
    restart_backoff_initial_s: Seconds = Field(default=1.0,
        description="First wait before restarting a dead engine; doubled after each death.")
    restart_backoff_max_s: Seconds = Field(default=60.0, description="Longest wait between restarts.")
    max_failures: Annotated[int, Field(ge=1)] = Field(default=5,
        description="Deaths within failure_window_s before the daemon gives up and exits 1.")
    failure_window_s: Seconds = Field(default=600.0, description="The window max_failures counts deaths in.")

    @model_validator(mode="before")
    @classmethod
    def _port_is_gone(cls, data: Any) -> Any:
        # engine.port (a loopback TCP port any local user could reach) was replaced by the private socket:
        # an older configuration that still names it keeps working, and the port is not opened.
        if isinstance(data, dict) and "port" in data:
            data = {k: v for k, v in data.items() if k != "port"}
            logging.getLogger(__name__).warning(
                "engine.port is no longer used: the engine listens on a private Unix socket "
                "(engine.socket_dir); remove engine.port from the configuration")
        return data

    @field_validator("extra_args")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        owned = {"--model", "--port", "--host", "--uds", "--served-model-name", "--api-key"}
        for arg in v:
            if arg.split("=", 1)[0] in owned:
                raise ValueError(f"{arg.split('=', 1)[0]} is set by the appliance itself; remove it")
        return v


class TargetsSection(_Section):
    """What the site needs; the planner turns it into engine settings (kvbudget)."""

    sessions: Annotated[int, Field(ge=1)] | None = Field(default=None,
        description="Concurrent sessions wanted at `context`; unset: none asked.")
    context: Annotated[int, Field(ge=16)] | None = Field(default=None,
        description="Tokens per session; unset: the workload's default (32k; 128k for long-context).")
    workload: Workload = Field(default="chat",
        description="What the site runs; chooses speculative decoding and the default context.")
    kv_dtype: KvDtype = Field(default="auto",
        description="KV cache dtype; auto: FP8 where the GPU has it (compute capability 8.9+) or the CPU "
                    "host has AVX-512/AMX, else the model's dtype.")
    weights: WeightTarget = Field(
        default="auto", description="Weight precision. auto: a BF16/FP16 checkpoint on a card with FP8 is "
        "quantized to FP8 by vLLM as it loads (--quantization fp8) when it does not fit otherwise or gains "
        "`fp8_weights_gain` more sessions; model: as stored; fp8: always (GPUs of compute capability 7.5+).")
    fp8_weights_gain: Annotated[float, Field(ge=0)] = Field(
        default=0.25, description="The share more sessions at `context` that makes `weights = \"auto\"` take "
                                  "FP8 weights on a model that fits either way (0.25: a quarter more).")
    ttft_p50_ms: Annotated[float, Field(gt=0)] | None = Field(default=None,
        description="Median time-to-first-token target, recorded with the plan.")
    tpot_ms: Annotated[float, Field(gt=0)] | None = Field(default=None,
        description="Time per output token target, checked against the memory-bandwidth floor of decoding.")
    speculative: SpeculativeTarget = Field(
        default="auto", description="off: never speculate (the doctor suggests it when acceptance decays).")
    prefix_caching: bool = Field(
        default=True, description="vLLM's prefix cache; off plans hybrid models with one state block per "
                                  "sequence (mamba cache mode none), so more sessions fit.")
    draft_model: Path | None = Field(
        default=None, description="A local EAGLE-3 draft folder (config.json + safetensors); enables EAGLE.")


def default_objectives() -> dict[PriorityClass, str]:
    return {"gold": "edge-gold", "silver": "edge-silver", "bronze": "edge-bronze"}


class RegionalSection(_Section):
    """The regional OpenAI-compatible cluster reached over the backhaul (used by cascade)."""

    enabled: bool = Field(default=False, description="Escalate to a regional cluster at all.")
    base_url: str = Field(default="", description="Like an OpenAI client's base URL, ending in /v1.")
    model: str = Field(default="", description="The regional model escalations of the local model go to.")
    models: list[str] = Field(default_factory=list,
                              description="Models clients may name that only the regional cluster serves.")
    token_file: Path | None = Field(default=None, description="Bearer token; the file must have mode 0600.")
    ca_bundle: Path | None = Field(default=None, description="TLS: the cluster's CA bundle; unset: the system's.")
    client_cert: Path | None = Field(default=None, description="TLS client certificate (mutual TLS).")
    client_key: Path | None = Field(default=None, description="Key of client_cert.")
    connect_timeout_s: Seconds = Field(default=3.0, description="Longest wait for a connection to the cluster.")
    read_timeout_s: Seconds = Field(default=120.0,
        description="Longest wait for an answer; a blackholed link costs this once per breaker opening.")
    retries: Annotated[int, Field(ge=0, le=5)] = Field(default=1,
        description="Extra attempts, only when the connection could not be made.")
    breaker_failures: Annotated[int, Field(ge=1)] = Field(default=3,
        description="Consecutive link failures that open the circuit breaker.")
    breaker_reset_s: Seconds = Field(default=10.0,
        description="First wait before a probe of an open breaker; doubled after each failed probe.")
    breaker_max_reset_s: Seconds = Field(default=300.0, description="Longest wait between probes.")
    forward_concurrency: Annotated[int, Field(ge=1, le=64)] = Field(default=4,
        description="Escalations the forwarder sends at once.")
    forward_poll_s: Seconds = Field(default=2.0, description="How often the forwarder looks for due escalations.")
    max_attempts: Annotated[int, Field(ge=1)] = Field(default=10,
        description="Answered errors (5xx, garbage) before an escalation is marked failed.")
    llm_d_headers: bool = Field(default=False,
        description="Send an llm-d inference gateway's scheduling headers with each escalation: the class's "
                    "objective, a fairness id, the class's TTFT target and tpot_slo_ms. Off for a plain OpenAI "
                    "endpoint.")
    objectives: dict[PriorityClass, str] = Field(
        default_factory=lambda: default_objectives(),
        description="InferenceObjective per priority class (x-gateway-inference-objective); the regional "
                    "cluster defines them (packaging/regional/).")
    fairness_id: str = Field(default="{site}/{tenant}", max_length=256,
        description="x-gateway-inference-fairness-id: {site} is site.name, {tenant} the key's tenant "
                    "(default when none).")
    tpot_slo_ms: dict[PriorityClass, Annotated[int, Field(ge=1)]] = Field(default_factory=dict,
        description="x-slo-tpot-ms per priority class; x-slo-ttft-ms is the class's own ttft_target_s.")

    @field_validator("fairness_id")
    @classmethod
    def _fairness_fields(cls, v: str) -> str:
        check_fairness_template(v)
        return v

    @model_validator(mode="after")
    def _url_when_enabled(self) -> RegionalSection:
        if self.enabled:
            if not self.base_url.startswith(("http://", "https://")):
                raise ValueError("base_url must be an http:// or https:// URL when enabled = true")
            if not self.model:
                raise ValueError("model (the regional model escalations go to) is required when enabled = true")
            if bool(self.client_key) and not self.client_cert:
                raise ValueError("client_key needs client_cert")
        return self


class ThresholdsSection(_Section):
    """Escalate under `auto` when a signal is below its threshold (bench/cascade_eval.py chose the default)."""

    quantile_logprob: float | None = Field(default=-1.6,
        description="Escalate when the answer's low-quantile token log-probability is below this.")  # pooled 30% escalation point of bench/cascade_eval.py
    mean_logprob: float | None = Field(default=None,
        description="Escalate when the mean token log-probability is below this.")
    min_logprob: float | None = Field(default=None,
        description="Escalate when the lowest token log-probability is below this.")
    neg_mean_entropy: float | None = Field(default=None,
        description="Escalate when the negative mean top-k entropy is below this.")
    quantile: Annotated[float, Field(ge=0, le=1)] = Field(default=0.1,
        description="Which quantile quantile_logprob takes.")


Share = Annotated[float, Field(gt=0, lt=1)]
WebhookUrl = Annotated[str, Field(pattern=r"^https?://[^\s/]+\S*$")]


class TenantSection(_Section):
    escalate: Escalate | None = Field(default=None, description="This tenant's policy; unset: [policy] escalate.")
    mode: Mode | None = Field(default=None, description="This tenant's mode; unset: [policy] mode.")
    local_only: bool = Field(default=False, description="This tenant's data never leaves the site.")
    escalation_share: Share | None = Field(default=None,
        description="This tenant's escalation budget under auto; unset: [policy] escalation_share.")
    webhook_url: WebhookUrl | None = Field(default=None,
        description="Called with the regional answer (and its agreement with the local one) once an escalation "
                    "of this tenant is answered; unset: [policy] webhook_url.")
    webhook_secret_file: Path | None = Field(default=None,
        description="The HMAC key webhook calls are signed with (X-Appliance-Signature); mode 0600.")

    @model_validator(mode="after")
    def _webhook_needs_a_secret(self) -> Any:
        if self.webhook_url is not None and self.webhook_secret_file is None:
            raise ValueError("webhook_url needs webhook_secret_file: every call is signed")
        return self


class PolicySection(_Section):
    """Escalation policy (used by cascade): defaults, thresholds, tenants, and the outbox's bounds."""

    escalate: Escalate = Field(default="never", description="Default policy; per request: X-Appliance-Escalate.")
    mode: Mode = Field(default="async",
        description="Default escalation mode; per request: X-Appliance-Escalation-Mode.")
    thresholds: ThresholdsSection = Field(default_factory=ThresholdsSection)
    escalation_share: Share | None = Field(default=None,
        description="Under auto, escalate this share of judged answers (per route and tenant): the threshold "
                    "follows the quantile_logprob of the last budget_window answers instead of staying fixed. "
                    "Unset: the fixed thresholds.")
    budget_window: Annotated[int, Field(ge=10, le=100_000)] = Field(default=500,
        description="Judged answers per route and tenant the budget's threshold is read over.")
    budget_warmup: Annotated[int, Field(ge=1)] = Field(default=50,
        description="Judged answers before the budget's threshold replaces the fixed one.")
    shadow_share: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.0,
        description="Under auto, this share of the answers the judge kept is also sent to the regional cluster for "
                    "a label only (the client keeps its answer and is told nothing); never local-only data. Off: 0.")
    calibrate: bool = Field(default=True,
        description="Learn from the outbox's labels which local answers the regional cluster disagrees with; the "
                    "budget ranks by the learned score only while it beats quantile_logprob on held-out labels.")
    calibrate_every_s: Seconds = Field(default=3600.0, description="How often the calibrator is refitted.")
    calibrate_min_labels: Annotated[int, Field(ge=20)] = Field(default=200,
        description="Labels a fit needs (30% of them are held out to judge it).")
    webhook_url: WebhookUrl | None = Field(default=None,
        description="Called with the regional answer (and its agreement with the local one) once an escalation "
                    "is answered, for every tenant without its own; signed with webhook_secret_file.")
    webhook_secret_file: Path | None = Field(default=None,
        description="The HMAC key webhook calls are signed with (X-Appliance-Signature); mode 0600.")
    tenants: dict[str, TenantSection] = Field(default_factory=dict)
    outbox_max_pending: Annotated[int, Field(ge=1)] = Field(default=50_000,
        description="Waiting escalations; at the bound new ones are refused and the local answer kept.")
    outbox_max_age_s: Seconds = Field(default=7 * 86400.0,
        description="Queued longer than this: expired, not sent (`appliance escalations retry`).")

    @model_validator(mode="after")
    def _webhook_needs_a_secret(self) -> Any:
        if self.webhook_url is not None and self.webhook_secret_file is None:
            raise ValueError("webhook_url needs webhook_secret_file: every call is signed")
        return self


class AuthSection(_Section):
    """Access control (API keys are managed in the state database)."""

    require_keys: Literal["auto", "always", "never"] = Field(
        default="auto", description="auto: keys required unless listening on loopback only."
    )


class ClassSection(_Section):
    """One priority class: its TTFT target, its token limit, its queue and its reserved share."""

    ttft_target_s: Seconds = Field(
        description="Refuse at once (429) when the predicted time to first token exceeds it.")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(default=None, description="Unset: no class limit.")
    queue_limit: Annotated[int, Field(ge=0)] = Field(default=64,
        description="Requests of this class that may wait for a slot.")
    reserved_share: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.0,
        description="Share of capacity held for this class while it is active, lent to the others while "
                    "it is not, and taken back at once (the engine preempts lower classes) when it returns.")
    restart_hold_s: Annotated[float, Field(ge=0)] | None = Field(default=None,
        description="How long this class's requests wait for a restarting engine; unset: server.restart_hold_s.")


def _default_classes() -> dict[PriorityClass, ClassSection]:
    return {
        "gold": ClassSection(ttft_target_s=2.0, queue_limit=64, reserved_share=0.25),
        "silver": ClassSection(ttft_target_s=5.0, queue_limit=64),
        "bronze": ClassSection(ttft_target_s=15.0, queue_limit=32),
    }


class AdmissionSection(_Section):
    """Admission control by priority class (the class comes from the API key)."""

    enabled: bool = Field(default=True, description="Admission control by priority class.")
    capacity: Annotated[int, Field(ge=1)] | None = Field(
        default=None, description="Requests the engine runs at once; unset: the plan's max_num_seqs.")
    anonymous_class: PriorityClass = Field(
        default="silver", description="Class of requests without a key (only possible on loopback).")
    kv_high_water: Annotated[float, Field(gt=0, le=1)] = Field(default=0.95,
        description="Above this KV usage nothing new is admitted (vLLM would preempt).")
    reserve_memory_s: Annotated[float, Field(ge=0)] = Field(default=5.0,
        description="How long a class's reserved share stays held after its last request ends.")
    classes: dict[PriorityClass, ClassSection] = Field(default_factory=_default_classes)
    refuse_late: bool = Field(default=True,
        description="Refuse (429) a request predicted, or found while queued, to miss its class's TTFT target. "
                    "false: queue it all the same, to check the predictions (X-Appliance-Predicted-TTFT-Ms) "
                    "against what happens.")

    @field_validator("classes", mode="before")
    @classmethod
    def _over_defaults(cls, v: Any) -> Any:
        # A site that tunes one class keeps the other two, and a class table may set only some keys.
        if not isinstance(v, dict):
            return v
        merged: dict[str, Any] = {k: c.model_dump() for k, c in _default_classes().items()}
        for name, given in v.items():
            merged[name] = {**merged.get(name, {}), **given} if isinstance(given, dict) else given
        return merged

    @model_validator(mode="after")
    def _shares_fit(self) -> AdmissionSection:
        if sum(c.reserved_share for c in self.classes.values()) >= 1:
            raise ValueError("the classes' reserved_share values must add up to less than 1")
        if self.anonymous_class not in self.classes:
            raise ValueError(f"anonymous_class {self.anonymous_class!r} has no entry under admission.classes")
        return self


class KernelsSection(_Section):
    """The native engine code every replica must load byte for byte (`appliance kernels lock`)."""

    lock: Path | None = Field(default=None, description="The kernel lock file; unset: not checked.")
    verify: Verify = Field(
        default="warn", description="At start: refuse (fail, the packaged default) or log (warn) a mismatch.")


class DoctorSection(_Section):
    """What the daemon does about the doctor's live recipes itself, beyond reporting them."""

    disable_decayed_speculation: bool = Field(
        default=False, description="Relaunch the engine without speculative decoding once its acceptance has "
                                   "decayed; lasts until the service restarts (targets.speculative = \"off\" "
                                   "makes it permanent).")
    check_interval_s: Annotated[float, Field(ge=1)] = Field(
        default=300.0, description="How often the daemon applies the recipes it may act on.")
    relaunch_drain_s: Annotated[float, Field(ge=0)] = Field(
        default=120.0, description="Before relaunching the engine, how long to let the requests it is answering "
                                   "finish (new ones get 503 meanwhile); those still running then are cut off.")
    grow_escalation_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.3, description="The doctor's grow advisor says the box has outgrown itself when at least this "
                                 "share of its answered requests was escalated over the last half hour.")


class UpgradeSection(_Section):
    """`appliance upgrade`: how a new model or engine is checked before it takes traffic, and watched after."""

    golden_set: Path | None = Field(
        default=None, description="The site's golden set (JSON lines: prompt, expect, json, max_latency_s); "
                                  "unset: the packaged one (a few general questions).")
    min_agreement: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.5, description="The new model's greedy answers to the golden set must agree at least this much "
                                 "(mean word-sequence similarity, 0 to 1) with the running model's answers.")
    gate_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=120.0, description="Longest the golden set may take on the new engine; past it the gate fails.")
    drain_s: Annotated[float, Field(ge=0)] = Field(
        default=120.0, description="Before the old engine stops, how long the answers it is giving may take to "
                                   "finish (new requests are held meanwhile: server.restart_hold_s).")
    swap: Literal["auto", "beside", "in_place"] = Field(
        default="auto", description="How the new engine replaces the running one: beside it (both run until the "
                                    "switch, no request waits; needs memory for both), in place (drained and "
                                    "stopped first, new requests held), or auto: beside for a GPU engine when the card has "
                                    "the free memory, in place for the CPU engine.")
    hold_s: Annotated[float, Field(ge=0)] = Field(
        default=300.0, description="While an upgrade swaps in place (or rolls back), a new request waits this "
                                   "long for the new engine, when it is longer than the restart hold "
                                   "(server.restart_hold_s, per class): a load plus the gate takes longer than "
                                   "a restart (about 100 s for the CPU engine with compilation).")
    probation_s: Annotated[float, Field(ge=0)] = Field(
        default=300.0, description="After the swap, how long the new engine is watched before its version is "
                                   "committed; a death or too many errors in that time roll it back.")
    probation_max_error_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.2, description="In probation, the share of local answers with a 5xx status that rolls back "
                                 "(judged once at least probation_min_requests were answered).")
    probation_min_requests: Annotated[int, Field(ge=1)] = Field(
        default=10, description="Answers needed before probation judges the error share.")


class Config(_Section):
    site: SiteSection = Field(default_factory=SiteSection)
    model: ModelSection
    server: ServerSection = Field(default_factory=ServerSection)
    state: StateSection = Field(default_factory=StateSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    targets: TargetsSection = Field(default_factory=TargetsSection)
    regional: RegionalSection = Field(default_factory=RegionalSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    auth: AuthSection = Field(default_factory=AuthSection)
    admission: AdmissionSection = Field(default_factory=AdmissionSection)
    kernels: KernelsSection = Field(default_factory=KernelsSection)
    doctor: DoctorSection = Field(default_factory=DoctorSection)
    upgrade: UpgradeSection = Field(default_factory=UpgradeSection)

    source: Path | None = Field(default=None, exclude=True, description="The file this came from.")

    @model_validator(mode="after")
    def _keys_off_loopback(self) -> Config:
        if self.auth.require_keys == "never" and not is_loopback(self.server.host):
            raise ValueError(
                f"auth.require_keys = \"never\" is only allowed on loopback; server.host is {self.server.host}"
            )
        return self

    @property
    def served_name(self) -> str:
        return self.model.served_name or self.model.path.name

    @property
    def database_path(self) -> Path:
        return self.state.directory / "appliance.db"

    @property
    def engine_socket(self) -> Path:
        return (self.engine.socket_dir or self.state.directory / "engine") / "api.sock"

    @property
    def engine_cache_dir(self) -> Path:
        return self.engine.cache_dir or self.state.directory / "engine-cache"


_PATH_FIELDS = {
    ("model", "path"),
    ("state", "directory"),
    ("engine", "cache_dir"),
    ("regional", "token_file"),
    ("regional", "ca_bundle"),
    ("regional", "client_cert"),
    ("regional", "client_key"),
    ("kernels", "lock"),
    ("upgrade", "golden_set"),
}


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    for section, key in _PATH_FIELDS:
        sec = raw.get(section)
        if isinstance(sec, dict) and isinstance(sec.get(key), str) and sec[key]:
            p = Path(os.path.expanduser(sec[key]))
            sec[key] = str(p if p.is_absolute() else (base / p).resolve())


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = e["loc"][:-1]
            allowed = _allowed_keys(parent)
            lines.append(f"  {key}: unknown key; allowed here: {', '.join(allowed)}")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required but missing")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            hint = ""
            if e["type"].startswith("byte_size"):
                hint = '; use a byte size such as 1073741824, "512MiB" or "2GB"'
            lines.append(f"  {key}: {e['msg']}{shown}{hint}")
    return "\n".join(lines)


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            break
        model = field.annotation
    return [name for name, f in model.model_fields.items() if not f.exclude]


def parse(text: str, source: str = "<string>", base: Path | None = None) -> Config:
    """Parse and validate TOML text. Raises ConfigError with a message naming the bad key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None
    _resolve_paths(raw, base or Path.cwd())
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
    return cfg


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    if explicit:
        return Path(explicit)
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else DEFAULT_CONFIG_PATH


def load(explicit: str | os.PathLike[str] | None = None) -> Config:
    """Load the configuration from --config, $APPLIANCE_CONFIG or the default path."""
    path = config_path(explicit)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"configuration file {path} does not exist; pass --config PATH or set {CONFIG_ENV}"
        ) from None
    except (PermissionError, IsADirectoryError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read configuration file {path}: {e}") from None
    cfg = parse(text, source=str(path), base=path.parent.resolve())
    cfg.source = path
    return cfg
