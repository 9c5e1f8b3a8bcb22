"""appliance serve: the daemon."""

from __future__ import annotations

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

    cfg = load_config(config_path)
    problems = runtime_problems(cfg)  # before logging starts: plain lines on stderr for the operator
    if problems:
        raise CliError("\n".join(problems))
    logs.setup(log_level.upper())
    try:
        ready = prepare(cfg)
    except StartupError as e:
        raise CliError(str(e)) from None
    sys.exit(run_daemon(ready))
