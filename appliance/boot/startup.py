"""What must hold before the engine starts: the one start-up policy that `serve` runs and `doctor` reports.

Pure checks against the machine (files, permissions, the regional credentials) come first; then the model
and kernel pins per model.verify / kernels.verify; then the plan. Each step raises StartupError with
what the operator should do, never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from appliance.boot.config import Config
from appliance.boot.model_pin import ModelCheck
from appliance.boot.planning import PlanningError, SitePlan, plan_for_config
from appliance.upgrade.versions import Outcome
from kernels.lock import KernelCheck

log = logging.getLogger("appliance")


class StartupError(Exception):
    """The appliance must not start; the message says what to change."""


def runtime_problems(cfg: Config) -> list[str]:
    """Problems that only show against the machine (missing model files, unwritable state, bad credentials).

    Each names the setting it concerns; the doctor asks the area it reports on (model_problems, ...).
    """
    from appliance.boot.library_pins import library_problems

    return [*library_problems(), *model_problems(cfg), *engine_problems(cfg), *_regional_problems(cfg),
            *state_problems(cfg)]


def model_problems(cfg: Config) -> list[str]:
    mp = cfg.model.path
    if not mp.is_dir():
        return [f"model.path {mp} is not a folder; the appliance loads models only from local paths "
                "(run `appliance model install-default` for the embedded default)"]
    if not (mp / "config.json").is_file():
        return [f"model.path {mp} has no config.json: not a Hugging Face model folder"]
    if not any(mp.glob("*.safetensors")) and not any(mp.glob("*.bin")):
        return [f"model.path {mp} has no weight files (*.safetensors or *.bin)"]
    return _label_problems(mp)


def _label_problems(mp: Path) -> list[str]:
    """Weights the config mislabels, or a header that does not parse, refused before the engine starts."""
    from kvbudget.checkpoint import CheckpointError, label_problem

    try:
        config = json.loads((mp / "config.json").read_text())
        problem = label_problem(mp, config) if isinstance(config, dict) else "config.json is not a JSON object"
    except CheckpointError as e:
        problem = str(e)
    except ValueError as e:
        problem = f"config.json is not JSON ({e})"
    return [f"model.path {mp}: {problem}"] if problem else []


def engine_problems(cfg: Config) -> list[str]:
    if cfg.engine.python and not os.access(cfg.engine.python, os.X_OK):
        return [f"engine.python {cfg.engine.python} is not an executable interpreter: install the engine's "
                "environment there (the fleet's vLLM) or leave engine.python unset"]
    return []


def _regional_problems(cfg: Config) -> list[str]:
    if not cfg.regional.enabled:
        return []
    from appliance.boot.escalation import regional_settings, webhooks
    from cascade.regional import TLSFileError, TokenFileError, read_token, tls_verify

    out = []
    for check in (lambda: read_token(cfg.regional.token_file), lambda: tls_verify(regional_settings(cfg)),
                  lambda: webhooks(cfg)):
        try:
            check()
        except (TokenFileError, TLSFileError) as e:
            out.append(str(e))
    return out


def state_problems(cfg: Config) -> list[str]:
    sd = cfg.state.directory
    probe = sd
    while not probe.exists() and probe != probe.parent:  # the daemon creates the missing part
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        return [f"state.directory {sd} cannot be created or written by this user ({probe} is not writable)"]
    return []


def hash_model(cfg: Config, what: str) -> ModelCheck:
    """The model folder hashed against its pin, with a progress bar; StartupError when a file is unreadable."""
    from appliance.boot import model_pin

    try:
        with model_pin.progress_bar(cfg.model.path, what) as bar:
            return model_pin.check(cfg.model.path, cfg.model.digest or None, bar.update)
    except OSError as e:
        raise StartupError(f"cannot read the model folder {cfg.model.path}: {e.strerror}: {e.filename}; the "
                           "service user must be able to read every file in it") from None


def verify_model(cfg: Config) -> ModelCheck | None:
    """model.verify: "fail" refuses a changed model, "warn" logs it, "off" skips the hashing."""
    if cfg.model.verify == "off":
        return None
    check = hash_model(cfg, "verifying model")
    if not check.ok and cfg.model.verify == "fail":
        raise StartupError(f"{check.describe()}; refusing to start (model.verify = \"fail\")")
    (log.info if check.ok else log.warning)("%s", check.describe())
    return check


def verify_kernels(cfg: Config) -> KernelCheck | None:
    """kernels.verify against kernels.lock, the same way as the model."""
    if cfg.kernels.lock is None or cfg.kernels.verify == "off":
        return None
    from kernels import lock as kernel_lock

    check = kernel_lock.check(cfg.kernels.lock, cfg.engine.python or None)
    if not check.ok and cfg.kernels.verify == "fail":
        raise StartupError(f"{check.describe()}; refusing to start (kernels.verify = \"fail\"); run "
                           "`appliance kernels verify` for every file")
    (log.info if check.ok else log.warning)("%s", check.describe())
    return check


@dataclass(frozen=True)
class Ready:
    """Everything the daemon is built from, checked."""

    cfg: Config
    site_plan: SitePlan
    model_check: ModelCheck | None
    kernel_check: KernelCheck | None
    file_cfg: Config | None = None  # the configuration file's own, when the box serves an upgraded version
    recovered: Outcome | None = None  # an upgrade the daemon was killed in, as the restart found it


def prepare(cfg: Config, file_cfg: Config | None = None, recovered: Outcome | None = None) -> Ready:
    """The rest of `appliance serve`'s start-up once runtime_problems found nothing: pins, then the plan."""
    model_check = verify_model(cfg)
    kernel_check = verify_kernels(cfg)
    try:
        site_plan = plan_for_config(cfg)
    except PlanningError as e:
        raise StartupError(f"cannot plan the engine: {e}") from None
    return Ready(cfg, site_plan, model_check, kernel_check, file_cfg, recovered)
