"""appliance kernels lock|verify|sbom: the engine's native code, pinned and described."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from appliance import __version__
from appliance.cli.common import EXIT_FAILED, CliError, config_exists, config_option, load_config


@click.group("kernels")
def kernels_group() -> None:
    """The engine's native code: lock it, verify it, describe it as an SBOM."""


def _lock_path(config_path: Path | None, output: Path | None) -> tuple[Path, str | None]:
    if output is not None:
        python = (load_config(config_path).engine.python or None) if config_exists(config_path) else None
        return output, python
    cfg = load_config(config_path)
    if cfg.kernels.lock is None:
        raise CliError("kernels.lock is not set in the configuration; pass --lock PATH")
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
        raise CliError(str(e)) from None
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
        raise CliError(result.error)
    click.echo(result.describe() if result.ok else f"engine kernels differ from the lock {path} ({result.digest}):")
    for m in result.mismatches:
        click.echo(f"  {m}")
    sys.exit(0 if result.ok else EXIT_FAILED)


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

    if lock_path is None and config_exists(config_path):
        lock_path = load_config(config_path).kernels.lock
    lock = None
    if lock_path is not None:
        try:
            lock = kernel_lock.read(lock_path)
        except kernel_lock.LockError as e:
            raise CliError(str(e)) from None
    text = sbom.to_json(sbom.build(lock, __version__))
    if output:
        output.write_text(text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text)
