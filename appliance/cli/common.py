"""What every command shares: the --config option, loading it, the one error type and its exit codes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import click

from appliance.boot import config as config_mod

EXIT_FAILED = 1  # the command ran and found a problem (a check failed, a target missed, the engine gave up)
EXIT_USAGE = 2  # bad usage, an invalid configuration, or a machine the appliance cannot start on


class CliError(click.ClickException):
    """An operator-facing failure: each line printed as "error: ...", then exit with its code."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class; one per error here

    def show(self, file: Any = None) -> None:
        for line in self.format_message().splitlines():
            click.echo(f"error: {line}", err=True)


def choice(literal: Any, **kw: Any) -> click.Choice:
    """A click choice of exactly the values a Literal type allows (the type is the one definition)."""
    return click.Choice(list(get_args(literal)), **kw)


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Configuration file (default: ${config_mod.CONFIG_ENV} or {config_mod.DEFAULT_CONFIG_PATH}).",
)


def load_config(config_path: Path | None) -> config_mod.Config:
    try:
        return config_mod.load(config_path)
    except config_mod.ConfigError as e:
        raise CliError(str(e)) from None


def config_exists(config_path: Path | None) -> bool:
    """Whether a configuration was named or the default one exists (commands that can do without one)."""
    return config_path is not None or config_mod.config_path(None).exists()


def size(value: str | None) -> int | None:
    """A byte size given as 1073741824 or 1GiB."""
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
