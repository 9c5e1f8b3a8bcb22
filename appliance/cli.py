"""The one command line entry point: `appliance <subcommand>`.

Exit statuses: 0 success, 1 runtime failure (engine gave up, checks failed),
2 bad usage or an invalid configuration.
"""

from __future__ import annotations

import json
import sys
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

    cfg = _load(config_path)
    problems = config_mod.check_runtime(cfg)
    if problems:
        for p in problems:
            click.echo(f"error: {p}", err=True)
        sys.exit(EXIT_USAGE)
    logs.setup(log_level.upper())
    sys.exit(run_daemon(cfg))


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

    cfg = _load(config_path)
    data = json.loads(cfg.model_dump_json())
    data["engine_command"] = describe(build_launch(cfg, cfg.engine.port or 0, internal_key="(generated at start)"))
    click.echo(json.dumps(data, indent=2))


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
