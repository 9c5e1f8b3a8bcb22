"""The one command line entry point: `appliance <subcommand>`.

Exit statuses: 0 success, 1 runtime failure (engine gave up, checks failed),
2 bad usage or an invalid configuration.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import click

from appliance import __version__
from appliance import config as config_mod

EXIT_USAGE = 2

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Configuration file (default: ${config_mod.CONFIG_ENV} or {config_mod.DEFAULT_CONFIG_PATH}).",
)


def _load(config_path: Path | None) -> config_mod.Config:
    try:
        return config_mod.load(config_path)
    except config_mod.ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="appliance")
def main() -> None:
    """Edge LLM inference appliance: one supervised vLLM behind a local OpenAI-compatible API."""


@main.command()
@config_option
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def serve(config_path: Path | None, log_level: str) -> None:
    """Start the engine and serve the local API until stopped."""
    from appliance import logs
    from appliance.daemon import serve as run_daemon

    from appliance.planning import PlanningError, plan_for_config

    cfg = _load(config_path)
    problems = config_mod.check_runtime(cfg)
    if problems:
        for p in problems:
            click.echo(f"error: {p}", err=True)
        sys.exit(EXIT_USAGE)
    logs.setup(log_level.upper())
    model_check = None
    if cfg.model.verify != "off":
        from appliance import model_pin

        try:
            with model_pin.progress_bar(cfg.model.path, "verifying model") as bar:
                model_check = model_pin.check(cfg.model.path, cfg.model.digest or None, bar.update)
        except OSError as e:
            click.echo(f"error: cannot read the model folder {cfg.model.path}: {e.strerror}: {e.filename}; the "
                       "service user must be able to read every file in it", err=True)
            sys.exit(EXIT_USAGE)
        if not model_check.ok and cfg.model.verify == "fail":
            click.echo(f"error: {model_check.describe()}; refusing to start (model.verify = \"fail\")", err=True)
            sys.exit(EXIT_USAGE)
        (logging.getLogger("appliance").warning if not model_check.ok else logging.getLogger("appliance").info)(
            "%s", model_check.describe())
    kernel_check = None
    if cfg.kernels.lock is not None and cfg.kernels.verify != "off":
        from kernels import lock as kernel_lock

        kernel_check = kernel_lock.check(cfg.kernels.lock, cfg.engine.python or None)
        if not kernel_check.ok and cfg.kernels.verify == "fail":
            click.echo(f"error: {kernel_check.describe()}; refusing to start (kernels.verify = \"fail\"); "
                       "run `appliance kernels verify` for every file", err=True)
            sys.exit(EXIT_USAGE)
        (logging.getLogger("appliance").warning if not kernel_check.ok else logging.getLogger("appliance").info)(
            "%s", kernel_check.describe())
    try:
        site_plan = plan_for_config(cfg)
    except PlanningError as e:
        click.echo(f"error: cannot plan the engine: {e}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(run_daemon(cfg, site_plan, model_check, kernel_check))


@main.group("config")
def config_group() -> None:
    """Validate or show the configuration."""


@config_group.command("check")
@config_option
def config_check(config_path: Path | None) -> None:
    """Validate a configuration file without starting anything."""
    cfg = _load(config_path)
    problems = config_mod.check_runtime(cfg)
    for p in problems:
        click.echo(f"error: {p}", err=True)
    if problems:
        sys.exit(1)
    click.echo(f"{cfg.source}: OK (model '{cfg.served_name}', API http://{cfg.server.host}:{cfg.server.port}/v1)")


@config_group.command("show")
@config_option
def config_show(config_path: Path | None) -> None:
    """Print the effective configuration (defaults filled in, paths resolved) and the engine command."""
    from appliance.engine.args import build_launch, describe
    from appliance.planning import PlanningError, plan_for_config

    cfg = _load(config_path)
    data = json.loads(cfg.model_dump_json())
    try:
        args = plan_for_config(cfg).plan.vllm_args
        data["engine_command"] = describe(build_launch(cfg, args, cfg.engine.port or 0, internal_key="(at start)"))
    except PlanningError as e:
        data["engine_command"] = None
        data["plan_error"] = str(e)
    click.echo(json.dumps(data, indent=2))


def _size(value: str | None) -> int | None:
    from pydantic import ByteSize, TypeAdapter, ValidationError

    if value is None:
        return None
    try:
        n = int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise click.BadParameter(f"{value!r} is not a size; use bytes or a unit such as 96GiB or 102GB") from None
    if n <= 0:
        raise click.BadParameter(f"must be positive (got {value!r})")
    return n


@main.command("plan")
@config_option
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="Model folder or config.json (default: model.path from --config).")
@click.option("--gpu", "gpu_name", default=None, help='A named GPU profile, e.g. "RTX PRO 6000 Blackwell" (default: the GPU found by NVML).')
@click.option("--gpu-memory", default=None, help="Plan for a card of this much memory, e.g. 96GiB.")
@click.option("--gpu-cc", default="8.0", show_default=True, help="Compute capability of a --gpu-memory card.")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 64), help="GPUs (tensor parallel).")
@click.option("--cpu", "cpu_backend", is_flag=True, help="Plan for vLLM's CPU backend (needs --kv-pool).")
@click.option("--kv-pool", default=None, help="Fix the KV pool (bytes or e.g. 1GiB) instead of deriving it.")
@click.option("--sessions", type=click.IntRange(min=1), default=None, help="Concurrent sessions wanted.")
@click.option("--context", type=click.IntRange(min=16), default=None, help="Context per session, tokens.")
@click.option("--workload", type=click.Choice(["chat", "code", "long-context", "tool-calling"]), default=None)
@click.option("--kv-dtype", type=click.Choice(["auto", "bf16", "fp16", "fp8", "fp4"]), default=None)
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), default=None, help="p50 TTFT target.")
@click.option("--tpot-ms", type=click.FloatRange(min=0, min_open=True), default=None, help="Time per output token target.")
@click.option("--draft-model", type=click.Path(path_type=Path), default=None,
              help="A local EAGLE-3 draft folder (enables EAGLE; its bytes and layers are read from it).")
@click.option("--prefix-caching", type=click.Choice(["on", "off"]), default=None,
              help="vLLM's prefix cache (default on; off fits more sessions of hybrid models).")
@click.option("--engine-python", default=None, help="The engine environment's interpreter (default: engine.python, "
              "else this one when vLLM is installed here).")
@click.option("--model-only", is_flag=True, help="Use the kvbudget model alone; do not ask vLLM (faster, no engine).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plan_cmd(config_path, model_path, gpu_name, gpu_memory, gpu_cc, gpus, cpu_backend, kv_pool, sessions, context,
             workload, kv_dtype, ttft_ms, tpot_ms, draft_model, prefix_caching, engine_python, model_only,
             as_json) -> None:
    """Compute the KV budget and the vLLM settings for a model on a GPU, against the site's targets.

    When an engine environment exists, vLLM itself checks the plan's command line and its figures
    replace the kvbudget model's (the plan names its source). Exit 0 when every target is met, 1 when a
    target is missed or the model does not fit (the plan says by how much and what would help), 2 for
    bad input or a plan vLLM refuses.
    """
    from appliance.planning import device_for, with_draft, with_vllm_figures
    from kvbudget.gpu import discover
    from kvbudget.model import ModelError, read_model
    from kvbudget.planner import PlanError, Platform, Targets, make_plan
    from kvbudget.profiles import UnknownGpu, custom_profile, find_profile, profile_from_discovery
    from kvbudget.render import plan_dict, plan_text

    cfg = _load(config_path) if config_path or (model_path is None) else None
    path = model_path or (cfg.model.path if cfg else None)
    if path is None:
        raise click.UsageError("give --model (or --config with model.path)")
    base = Targets()
    if cfg:
        from appliance.planning import targets_from_config

        base = targets_from_config(cfg)
    targets = Targets(
        sessions=sessions or base.sessions, context=context or base.context, workload=workload or base.workload,
        kv_dtype=kv_dtype or base.kv_dtype, ttft_p50_ms=ttft_ms or base.ttft_p50_ms, tpot_ms=tpot_ms or base.tpot_ms,
        speculative=base.speculative,
        prefix_caching=base.prefix_caching if prefix_caching is None else prefix_caching == "on",
    )
    try:
        targets = with_draft(targets, draft_model or (cfg.targets.draft_model if cfg else None))
        model = read_model(path)
        pool = _size(kv_pool) if kv_pool else (
            int(cfg.engine.kv_cache_memory_bytes) if cfg and cfg.engine.kv_cache_memory_bytes else None)
        discovered = False
        if cpu_backend:
            gpu, platform = None, Platform("cpu")
        else:
            platform = Platform("gpu", gpu_count=gpus)
            if gpu_name:
                gpu = find_profile(gpu_name)
            elif gpu_memory:
                major, _, minor = gpu_cc.partition(".")
                gpu = custom_profile(_size(gpu_memory), (int(major), int(minor or 0)))
            else:
                found = discover()
                if not found.found:
                    click.echo(f"error: {found.error}; name a GPU with --gpu (for example \"RTX PRO 6000 Blackwell\"), "
                               "give --gpu-memory, or plan for --cpu", err=True)
                    sys.exit(EXIT_USAGE)
                gpu = profile_from_discovery(found.gpus[0])
                platform = Platform("gpu", gpu_count=len(found.gpus) if gpus == 1 else gpus)
                discovered = True
        plan = make_plan(model, gpu, targets, platform, kv_pool_bytes=pool,
                         max_num_seqs=cfg.engine.max_num_seqs if cfg else None)
        if not model_only:
            python = engine_python or (cfg.engine.python if cfg else None) or None
            plan = with_vllm_figures(plan, path, device_for(gpu, platform, discovered), python)
    except (ModelError, PlanError, UnknownGpu, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(json.dumps(plan_dict(plan), indent=2) if as_json else plan_text(plan))
    sys.exit(0 if plan.targets_met else 1)


@main.command("gpus")
@click.option("--json", "as_json", is_flag=True)
def gpus_cmd(as_json: bool) -> None:
    """What NVML finds: every GPU's memory, compute capability, bandwidth, MIG mode, other processes."""
    from kvbudget.gpu import discover

    d = discover()
    if as_json:
        click.echo(json.dumps(d.as_dict(), indent=2))
    elif not d.found:
        click.echo(f"no GPU: {d.error}")
    else:
        click.echo(f"driver {d.driver_version}, CUDA {d.cuda_version}")
        for g in d.gpus:
            bw = f"{g.peak_bandwidth_bytes_s / 1e9:,.0f} GB/s" if g.peak_bandwidth_bytes_s else "bandwidth unknown"
            click.echo(f"  [{g.index}] {g.name}: {g.total_bytes / 2**20:,.0f} MiB total, {g.free_bytes / 2**20:,.0f} MiB free, "
                       f"cc {g.compute_capability[0]}.{g.compute_capability[1]}, {bw}, MIG {g.mig_mode}, "
                       f"other processes {g.other_process_bytes / 2**20:,.0f} MiB")
    for p in d.problems:
        click.echo(f"  problem: {p}", err=True)
    sys.exit(0 if d.found else 1)


@main.group("model")
def model_group() -> None:
    """Model folders: the embedded default."""


@model_group.command("install-default")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Target folder (default: $APPLIANCE_MODEL_CACHE or ~/.cache/appliance/models/SmolLM2-135M-Instruct).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--force", is_flag=True, help="Convert again even if the folder exists.")
def model_install_default(dest: Path | None, dtype: str, force: bool) -> None:
    """Convert the shipped SmolLM2-135M-Instruct GGUF to an HF folder once, and print its path."""
    from appliance.default_model import DefaultModelError, default_model_dir, install_default, is_converted

    target = dest or default_model_dir()
    if is_converted(target) and not force:
        click.echo(str(target))
        return
    click.echo(f"converting the embedded default model into {target} (once; about a minute)...", err=True)
    try:
        path = install_default(target, dtype=dtype, force=force)
    except DefaultModelError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(str(path))


@main.group("keys")
def keys_group() -> None:
    """API keys: stored hashed; each has a tenant, a priority class and optionally the admin scope."""


@keys_group.command("create")
@config_option
@click.option("--name", required=True, help="Who or what uses the key.")
@click.option("--tenant", default="default", show_default=True)
@click.option("--class", "priority_class", type=click.Choice(["gold", "silver", "bronze"]), default="silver",
              show_default=True, help="Priority class for admission control.")
@click.option("--admin", is_flag=True, help="Also allow /v1/appliance/* and the escalation routes.")
def keys_create(config_path: Path | None, name: str, tenant: str, priority_class: str, admin: bool) -> None:
    """Create a key and print it once (only its hash is stored)."""
    from appliance import keys

    cfg = _load(config_path)
    try:
        key, secret = keys.create(cfg.database_path, name, tenant, priority_class, admin)
    except keys.KeyProblem as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(f"created key {key.id} ({key.name}, tenant {key.tenant}, class {key.priority_class}"
               f"{', admin' if key.admin else ''}); it is shown only now:", err=True)
    click.echo(secret)


@keys_group.command("list")
@config_option
@click.option("--json", "as_json", is_flag=True)
def keys_list(config_path: Path | None, as_json: bool) -> None:
    """Every key with its id, name, tenant, class, scope and state (never the secret)."""
    from dataclasses import asdict

    from appliance import keys

    cfg = _load(config_path)
    rows = keys.list_keys(cfg.database_path) if cfg.database_path.exists() else []
    if as_json:
        click.echo(json.dumps([asdict(k) for k in rows], indent=2))
        return
    click.echo(f"{'id':14} {'name':20} {'tenant':12} {'class':7} {'admin':5} state")
    for k in rows:
        click.echo(f"{k.id:14} {k.name[:20]:20} {k.tenant[:12]:12} {k.priority_class:7} {str(k.admin):5} "
                   f"{'active' if k.active else 'revoked'}")


@keys_group.command("revoke")
@config_option
@click.argument("key_id")
def keys_revoke(config_path: Path | None, key_id: str) -> None:
    """Revoke a key by its id; the daemon refuses it within 5 seconds."""
    from appliance import keys

    cfg = _load(config_path)
    try:
        key = keys.revoke(cfg.database_path, key_id)
    except keys.KeyProblem as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(f"revoked {key.id} ({key.name})")


def _model_folder(config_path: Path | None, model: Path | None) -> tuple[Path, str | None]:
    if model is not None:
        return model, None
    cfg = _load(config_path)
    return cfg.model.path, cfg.model.digest or None


@model_group.command("pin")
@config_option
@click.option("--model", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model folder (default: model.path from the configuration).")
def model_pin_cmd(config_path: Path | None, model: Path | None) -> None:
    """Write the folder's manifest (every file's size and sha256) into it and print its digest."""
    from appliance import model_pin

    folder, _ = _model_folder(config_path, model)
    if not folder.is_dir():
        click.echo(f"error: {folder} is not a folder", err=True)
        sys.exit(EXIT_USAGE)
    with model_pin.progress_bar(folder, "hashing model") as bar:
        manifest = model_pin.pin(folder, bar.update)
    click.echo(f"pinned {len(manifest.files)} files, {manifest.total_bytes:,} bytes; "
               f"set model.digest = \"{manifest.digest}\" to pin it fleet-wide", err=True)
    click.echo(manifest.digest)


@model_group.command("verify")
@config_option
@click.option("--model", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--digest", default=None, help="Expected digest (default: model.digest, else the folder's manifest).")
def model_verify_cmd(config_path: Path | None, model: Path | None, digest: str | None) -> None:
    """Check the model folder against its pin; exit 1 naming each changed, missing or unexpected file."""
    from appliance import model_pin

    folder, pinned = _model_folder(config_path, model)
    if not folder.is_dir():
        click.echo(f"error: {folder} is not a folder", err=True)
        sys.exit(EXIT_USAGE)
    try:
        with model_pin.progress_bar(folder, "verifying model") as bar:
            result = model_pin.check(folder, digest or pinned, bar.update)
    except ValueError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    except OSError as e:
        click.echo(f"error: cannot read {e.filename}: {e.strerror}", err=True)
        sys.exit(EXIT_USAGE)
    if result.pinned is None:
        click.echo(f"error: {result.describe()}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(result.describe())
    for d in result.differences:
        click.echo(f"  {d.problem:12} {d.path}")
    sys.exit(0 if result.ok else 1)


@main.command("doctor")
@config_option
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-hash", is_flag=True, help="Skip hashing the model folder against its pin (large models).")
@click.option("--no-live", is_flag=True, help="Do not ask the running daemon for its live findings.")
@click.option("--key", envvar="APPLIANCE_API_KEY", default=None,
              help="Admin API key for the live findings when keys are required [env: APPLIANCE_API_KEY].")
def doctor_cmd(config_path: Path | None, as_json: bool, no_hash: bool, no_live: bool, key: str | None) -> None:
    """Check driver and GPU, engine, model and pin, state directory and regional link; with a running
    daemon also its engine and the troubleshooting recipes on live metrics. Exit 1 on any failure."""
    import httpx

    from appliance import doctor
    from appliance import model_pin
    from kvbudget.gpu import discover

    cfg = _load(config_path)
    model_check = None
    unreadable = None
    if not no_hash and cfg.model.path.is_dir():
        try:
            with model_pin.progress_bar(cfg.model.path, "hashing model") as bar:
                model_check = model_pin.check(cfg.model.path, cfg.model.digest or None, bar.update)
        except OSError as e:
            unreadable = doctor.Finding("model", "fail", f"cannot read {e.filename}: {e.strerror}",
                                        "the service user must be able to read every file of the model folder")
    findings = doctor.setup_checks(cfg, discover(), model_check)
    if unreadable is not None:
        findings = [unreadable if f.check == "model" else f for f in findings]
    if not no_live:
        host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{'[' + host + ']' if ':' in host else host}:{cfg.server.port}/v1/appliance/doctor"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            r = httpx.get(url, headers=headers, timeout=30)
            if r.status_code == 200:
                live = [doctor.Finding(**f) for f in r.json()["findings"]]
                setup_names = {f.check for f in findings}
                findings += [f for f in live if f.check not in setup_names]
            else:
                findings.append(doctor.Finding("daemon", "warn", f"the daemon at {url} answered {r.status_code}",
                                               "pass an admin key with --key or APPLIANCE_API_KEY"))
        except httpx.HTTPError:
            findings.append(doctor.Finding("daemon", "skip", f"no daemon answers at {url}: live checks skipped"))
    if as_json:
        click.echo(json.dumps(doctor.as_dict(findings), indent=2))
    else:
        click.echo(doctor.as_text(findings))
    sys.exit(1 if doctor.worst(findings) == "fail" else 0)


@main.command("init")
@click.option("--site-name", prompt="Site name (shown to the fleet)", help="This site's name.")
@click.option("--model-path", prompt="Model folder (a local Hugging Face folder)",
              type=click.Path(file_okay=False, path_type=Path), help="The served model's folder.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address the API listens on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--regional-url", prompt="Regional cluster URL (ending in /v1; empty: none)", default="",
              help="The regional OpenAI-compatible endpoint; empty: no escalation.")
@click.option("--regional-model", default="", help="The regional model escalations go to.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File holding the regional bearer token (mode 0600).")
@click.option("--token-stdin", is_flag=True, help="Read the regional token from standard input and write it to "
                                                  "--token-file (mode 0600, owned by the service user).")
@click.option("--escalate", type=click.Choice(["never", "auto", "always"]), default="auto", show_default=True,
              help="Default escalation policy when a regional cluster is configured.")
@click.option("--engine-python", default=None, help="The engine environment's interpreter (default: packaged).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--kernel-lock", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              default=config_mod.DEFAULT_CONFIG_PATH, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing configuration.")
def init_cmd(site_name: str, model_path: Path, host: str, port: int, regional_url: str, regional_model: str,
             token_file: Path | None, token_stdin: bool, escalate: str, engine_python: str | None,
             state_dir: Path | None, kernel_lock: Path | None, output: Path, force: bool) -> None:
    """Write this site's configuration from a few answers (prompted for when not given), with secure
    permissions; then `systemctl enable --now appliance`."""
    from appliance import site_init

    if output.exists() and not force:
        click.echo(f"error: {output} exists; pass --force to replace it", err=True)
        sys.exit(EXIT_USAGE)
    if regional_url and not regional_model:
        click.echo("error: --regional-model is required with --regional-url", err=True)
        sys.exit(EXIT_USAGE)
    if token_stdin:
        if token_file is None:
            click.echo("error: --token-stdin needs --token-file (where to keep the token)", err=True)
            sys.exit(EXIT_USAGE)
        token = sys.stdin.readline().strip()
        if not token:
            click.echo("error: no token on standard input", err=True)
            sys.exit(EXIT_USAGE)
        site_init.write_private(token_file, token + "\n", 0o600, owner_is_service=True)
    answers = site_init.Answers(site_name=site_name, model_path=model_path.resolve(), host=host, port=port,
                                regional_url=regional_url, regional_model=regional_model,
                                token_file=token_file.resolve() if token_file else None, escalate=escalate,
                                engine_python=engine_python, state_dir=state_dir.resolve() if state_dir else None,
                                kernel_lock=kernel_lock.resolve() if kernel_lock else None)
    try:
        text = site_init.render(answers)
    except config_mod.ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    site_init.write_private(output, text, 0o640, owner_is_service=False)
    cfg = config_mod.load(output)
    click.echo(f"wrote {output} (mode 0640)")
    for problem in config_mod.check_runtime(cfg):
        click.echo(f"note: {problem}", err=True)
    click.echo("next: appliance doctor; systemctl enable --now appliance", err=True)


@main.group("kernels")
def kernels_group() -> None:
    """The engine's native code: lock it, verify it, describe it as an SBOM."""


def _lock_path(config_path: Path | None, output: Path | None) -> tuple[Path, str | None]:
    if output is not None:
        python = None
        if config_path is not None or config_mod.config_path(None).exists():
            cfg = _load(config_path)
            python = cfg.engine.python or None
        return output, python
    cfg = _load(config_path)
    if cfg.kernels.lock is None:
        click.echo("error: kernels.lock is not set in the configuration; pass --lock PATH", err=True)
        sys.exit(EXIT_USAGE)
    return cfg.kernels.lock, cfg.engine.python or None


site_dir_option = click.option(
    "--site-dir", "site_dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
    help="Scan these site-packages folders instead of the engine's environment (an unpacked image, say).")


@kernels_group.command("lock")
@config_option
@click.option("--lock", "output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the lock (default: kernels.lock from the configuration).")
@site_dir_option
def kernels_lock_cmd(config_path: Path | None, output: Path | None, site_dirs: tuple[Path, ...]) -> None:
    """Record every native file of the engine's packages (vLLM, torch, Triton, attention kernels, CUDA)."""
    from kernels import lock as kernel_lock

    path, python = _lock_path(config_path, output)
    try:
        lock = kernel_lock.write(path, python, [str(d) for d in site_dirs] or None)
    except kernel_lock.LockError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    for p in lock["packages"]:
        click.echo(f"  {p['name']:28} {p['version']:16} {len(p['files']):>4} native files", err=True)
    click.echo(f"wrote {path}", err=True)
    click.echo(lock["digest"])


@kernels_group.command("verify")
@config_option
@click.option("--lock", "output", type=click.Path(dir_okay=False, path_type=Path), default=None)
@site_dir_option
def kernels_verify_cmd(config_path: Path | None, output: Path | None, site_dirs: tuple[Path, ...]) -> None:
    """Check the installed engine files against the lock; exit 1 naming each difference."""
    from kernels import lock as kernel_lock

    path, python = _lock_path(config_path, output)
    result = kernel_lock.check(path, python, [str(d) for d in site_dirs] or None)
    if result.error:
        click.echo(f"error: {result.error}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(result.describe() if result.ok else f"engine kernels differ from the lock {path} ({result.digest}):")
    for m in result.mismatches:
        click.echo(f"  {m}")
    sys.exit(0 if result.ok else 1)


@kernels_group.command("sbom")
@config_option
@click.option("--lock", "lock_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Include this lock's file hashes (default: kernels.lock when configured).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write here instead of standard output.")
def kernels_sbom_cmd(config_path: Path | None, lock_path: Path | None, output: Path | None) -> None:
    """A CycloneDX 1.6 JSON SBOM of this environment, with the kernel lock's hashes."""
    from kernels import lock as kernel_lock
    from kernels import sbom

    if lock_path is None and (config_path is not None or config_mod.config_path(None).exists()):
        lock_path = _load(config_path).kernels.lock
    lock = None
    if lock_path is not None:
        try:
            lock = kernel_lock.read(lock_path)
        except kernel_lock.LockError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_USAGE)
    text = sbom.to_json(sbom.build(lock, __version__))
    if output:
        output.write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text)


@main.group("escalations")
def escalations_group() -> None:
    """The escalation outbox: list, show, retry failed ones, purge finished ones.

    Works beside the running daemon (SQLite WAL); the daemon's forwarder picks up retried rows."""


def _outbox(config_path: Path | None):
    from appliance.escalation import OUTBOX_FILE, open_outbox

    cfg = _load(config_path)
    if not (cfg.state.directory / OUTBOX_FILE).exists():
        click.echo(f"no escalation outbox yet at {cfg.state.directory / OUTBOX_FILE}", err=True)
        sys.exit(0)
    return open_outbox(cfg)


@escalations_group.command("list")
@config_option
@click.option("--status", type=click.Choice(["queued", "sending", "done", "failed", "expired"]), default=None)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100000))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def escalations_list(config_path: Path | None, status: str | None, limit: int, as_json: bool) -> None:
    """Newest first, without prompt or answer text; a summary of the outbox at the end."""
    box = _outbox(config_path)
    rows = box.list(status, None, limit)
    if as_json:
        for e in rows:
            click.echo(json.dumps(e.summary()))
    else:
        click.echo(f"{'id':40} {'status':8} {'tries':>5} {'sends':>5} {'age':>8}  reason")
        now = time.time()
        for e in rows:
            click.echo(f"{e.id:40} {e.status:8} {e.attempts:>5} {e.sends:>5} {_age(now - e.created):>8}  "
                       f"{e.reason[:60]}")
    st = box.stats()
    click.echo(f"outbox: {st['depth']} waiting (oldest {_age(st['oldest_age_s'])}), "
               + ", ".join(f"{k} {v}" for k, v in st["counts"].items()), err=True)


@escalations_group.command("show")
@config_option
@click.argument("esc_id")
def escalations_show(config_path: Path | None, esc_id: str) -> None:
    """One escalation in full: the request as sent over the link and the regional answer."""
    e = _outbox(config_path).get(esc_id)
    if e is None:
        click.echo(f"error: no escalation with id {esc_id}", err=True)
        sys.exit(1)
    click.echo(json.dumps({**e.summary(), "request": e.request, "answer": e.answer}, indent=2))


@escalations_group.command("retry")
@config_option
@click.argument("ids", nargs=-1)
@click.option("--all-failed", is_flag=True, help="Every failed or expired escalation.")
def escalations_retry(config_path: Path | None, ids: tuple[str, ...], all_failed: bool) -> None:
    """Put failed or expired escalations back in the queue."""
    if not ids and not all_failed:
        click.echo("error: name escalation ids or pass --all-failed", err=True)
        sys.exit(EXIT_USAGE)
    n = _outbox(config_path).retry(None if all_failed else ids)
    click.echo(f"queued {n} escalation(s) again")
    if ids and n < len(ids):
        sys.exit(1)


@escalations_group.command("purge")
@config_option
@click.option("--status", "statuses", multiple=True, default=("done",), show_default=True,
              type=click.Choice(["done", "failed", "expired"]))
@click.option("--older-than-days", type=click.FloatRange(0), default=0.0, show_default=True)
def escalations_purge(config_path: Path | None, statuses: tuple[str, ...], older_than_days: float) -> None:
    """Delete finished escalations (never waiting ones)."""
    n = _outbox(config_path).purge(statuses, older_than_days * 86400)
    click.echo(f"purged {n} escalation(s)")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@main.command("requests")
@config_option
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 10000))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def requests_cmd(config_path: Path | None, limit: int, as_json: bool) -> None:
    """Show the most recent requests from the request log."""
    from appliance.store import recent_requests

    cfg = _load(config_path)
    if not cfg.database_path.exists():
        click.echo(f"no request log yet at {cfg.database_path}", err=True)
        return
    rows = recent_requests(cfg.database_path, limit)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
        return
    click.echo(f"{'id':38} {'status':>6} {'stream':>6} {'prompt':>6} {'compl':>6} {'ttft_ms':>8} {'total_ms':>9}  route")
    for r in rows:
        click.echo(
            f"{r['id']:38} {r['status']:>6} {bool(r['stream'])!s:>6} {_n(r['prompt_tokens']):>6} "
            f"{_n(r['completion_tokens']):>6} {_n(r['ttft_ms'], 1):>8} {_n(r['total_ms'], 1):>9}  {r['route']}"
        )


def _n(v: float | int | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if digits else str(v)


if __name__ == "__main__":
    main()
