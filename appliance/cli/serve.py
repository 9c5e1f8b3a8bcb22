"""appliance serve: the daemon."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from appliance.cli.common import CliError, config_option, load_config


@click.command()
@config_option
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def serve(config_path: Path | None, log_level: str) -> None:
    """Start the engine and serve the local API until stopped."""
    from appliance.boot.startup import StartupError, prepare, runtime_problems
    from appliance.runtime import logs
    from appliance.runtime.daemon import serve as run_daemon
    from appliance.upgrade.versions import Version, VersionsError, VersionStore, effective_config

    file_cfg = load_config(config_path)
    try:
        # An upgrade the last daemon was killed in ends here: the committed version serves, never a half-swap.
        recovered = VersionStore(file_cfg.state.directory).recover(Version.of(file_cfg))
        cfg, version_note = effective_config(file_cfg)
    except VersionsError as e:
        raise CliError(str(e)) from None
    problems = runtime_problems(cfg)  # before logging starts: plain lines on stderr for the operator
    if problems:
        raise CliError("\n".join(problems))
    logs.setup(log_level.upper())
    log = logging.getLogger("appliance")
    if recovered is not None:
        log.error("the %s %s to %s ended when the daemon stopped: %s (%s)", recovered.kind, recovered.id,
                  recovered.target, recovered.result, recovered.reason)
    if version_note:
        log.warning("%s", version_note)
    try:
        ready = prepare(cfg, file_cfg, recovered)
    except StartupError as e:
        raise CliError(str(e)) from None
    sys.exit(run_daemon(ready))
