"""appliance config check|show, and appliance init (writing a site's configuration)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from appliance.boot import config as config_mod
from appliance.boot.net import http_url
from appliance.cli.common import EXIT_FAILED, CliError, choice, config_option, load_config
from cascade.policy import Escalate


@click.group("config")
def config_group() -> None:
    """Validate or show the configuration."""


@config_group.command("check")
@config_option
def config_check(config_path: Path | None) -> None:
    """Validate a configuration file without starting anything."""
    from appliance.boot.startup import runtime_problems

    cfg = load_config(config_path)
    problems = runtime_problems(cfg)
    if problems:
        raise CliError("\n".join(problems), EXIT_FAILED)
    click.echo(f"{cfg.source}: OK (model '{cfg.served_name}', API "
               f"{http_url(cfg.server.host, cfg.server.port, '/v1')})")


@config_group.command("show")
@config_option
def config_show(config_path: Path | None) -> None:
    """Print the effective configuration (defaults filled in, paths resolved) and the engine command."""
    from appliance.boot.planning import PlanningError, plan_for_config
    from appliance.engine.args import build_launch, describe, engine_settings

    cfg = load_config(config_path)
    data = json.loads(cfg.model_dump_json())
    try:
        args = engine_settings(cfg, plan_for_config(cfg).plan).args
        data["engine_command"] = describe(build_launch(cfg, args, internal_key="(at start)"))
    except PlanningError as e:
        data["engine_command"] = None
        data["plan_error"] = str(e)
    click.echo(json.dumps(data, indent=2))


@click.command("init")
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
@click.option("--escalate", type=choice(Escalate), default="auto", show_default=True,
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
    from appliance.boot import site_init
    from appliance.boot.startup import runtime_problems

    if output.exists() and not force:
        raise CliError(f"{output} exists; pass --force to replace it")
    if regional_url and not regional_model:
        raise CliError("--regional-model is required with --regional-url")
    if token_stdin:
        if token_file is None:
            raise CliError("--token-stdin needs --token-file (where to keep the token)")
        token = sys.stdin.readline().strip()
        if not token:
            raise CliError("no token on standard input")
        site_init.write_private(token_file, token + "\n", 0o600, owner_is_service=True)
    answers = site_init.Answers(site_name=site_name, model_path=model_path.resolve(), host=host, port=port,
                                regional_url=regional_url, regional_model=regional_model,
                                token_file=token_file.resolve() if token_file else None, escalate=escalate,
                                engine_python=engine_python, state_dir=state_dir.resolve() if state_dir else None,
                                kernel_lock=kernel_lock.resolve() if kernel_lock else None)
    try:
        text = site_init.render(answers)
    except config_mod.ConfigError as e:
        raise CliError(str(e)) from None
    site_init.write_private(output, text, 0o640, owner_is_service=False)
    cfg = config_mod.load(output)
    click.echo(f"wrote {output} (mode 0640)")
    for problem in runtime_problems(cfg):
        click.echo(f"note: {problem}", err=True)
    click.echo("next: appliance doctor; systemctl enable --now appliance", err=True)
