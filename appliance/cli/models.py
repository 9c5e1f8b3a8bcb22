"""appliance model install-default|pin|verify: model folders and their pins."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from appliance.cli.common import EXIT_FAILED, CliError, config_option, load_config


@click.group("model")
def model_group() -> None:
    """Model folders: the embedded default, pinning and verifying."""


@model_group.command("install-default")
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Target folder (default: $APPLIANCE_MODEL_CACHE or ~/.cache/appliance/models/SmolLM2-135M-Instruct).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--force", is_flag=True, help="Convert again even if the folder exists.")
def model_install_default(dest: Path | None, dtype: str, force: bool) -> None:
    """Convert the shipped SmolLM2-135M-Instruct GGUF to an HF folder once, and print its path."""
    from appliance.boot.default_model import DefaultModelError, default_model_dir, install_default, is_converted

    target = dest or default_model_dir()
    if is_converted(target) and not force:
        click.echo(str(target))
        return
    click.echo(f"converting the embedded default model into {target} (once; about a minute)...", err=True)
    try:
        path = install_default(target, dtype=dtype, force=force)
    except DefaultModelError as e:
        raise CliError(str(e), EXIT_FAILED) from None
    click.echo(str(path))


def _model_folder(config_path: Path | None, model: Path | None) -> tuple[Path, str | None]:
    if model is not None:
        folder, pinned = model, None
    else:
        cfg = load_config(config_path)
        folder, pinned = cfg.model.path, cfg.model.digest or None
    if not folder.is_dir():
        raise CliError(f"{folder} is not a folder")
    return folder, pinned


@model_group.command("pin")
@config_option
@click.option("--model", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model folder (default: model.path from the configuration).")
def model_pin_cmd(config_path: Path | None, model: Path | None) -> None:
    """Write the folder's manifest (every file's size and sha256) into it and print its digest."""
    from appliance.boot import model_pin

    folder, _ = _model_folder(config_path, model)
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
    from appliance.boot import model_pin

    folder, pinned = _model_folder(config_path, model)
    try:
        with model_pin.progress_bar(folder, "verifying model") as bar:
            result = model_pin.check(folder, digest or pinned, bar.update)
    except ValueError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot read {e.filename}: {e.strerror}") from None
    if result.pinned is None:
        raise CliError(result.describe())
    click.echo(result.describe())
    for d in result.differences:
        click.echo(f"  {d.problem:12} {d.path}")
    sys.exit(0 if result.ok else EXIT_FAILED)


@model_group.command("quantize-env")
@click.option("--env", "env_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The environment's folder (default: $APPLIANCE_QUANTIZE_ENV or ~/.cache/appliance/quantize-env).")
def model_quantize_env(env_dir: Path | None) -> None:
    """Set up the environment LLM Compressor runs in (once; about a minute), and print its python."""
    click.echo(str(_quantize_python(env_dir)))


def _quantize_python(env_dir: Path | None) -> Path:
    from quantize import env

    folder = env_dir or env.default_dir()
    if not env.is_ready(folder):
        click.echo(f"setting up LLM Compressor in {folder} (its own environment: its pins and the engine's "
                   f"differ; once)...", err=True)
    try:
        return env.ensure(folder, folder.parent / f"{folder.name}.setup.log")
    except env.QuantizeEnvError as e:
        raise CliError(str(e), EXIT_FAILED) from None


@model_group.command("quantize")
@config_option
@click.argument("source", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--scheme", required=True, type=click.Choice(["w8a8-int8", "w4a16", "fp8-dynamic"]),
              help="w8a8-int8: int8 weights and activations (CPU with VNNI/AMX, GPUs); w4a16: 4-bit weights "
                   "(CPU, GPUs); fp8-dynamic: FP8, no calibration (GPUs with FP8 only).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="The build's folder.")
@click.option("--calibration", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="A JSONL file of {\"messages\": [...]} or {\"text\": ...} (default: the set the project ships).")
@click.option("--calibration-from-log", is_flag=True,
              help="Calibrate on the prompts this site's request log kept (needs state.log_prompts = true).")
@click.option("--samples", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Calibration conversations used at most.")
@click.option("--env", "env_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="LLM Compressor's environment (default: $APPLIANCE_QUANTIZE_ENV or ~/.cache/appliance/quantize-env).")
@click.option("--force", is_flag=True, help="Replace --out if it exists (the old build stays until the new one is in place).")
def model_quantize(config_path: Path | None, source: Path, scheme: str, out: Path, calibration: Path | None,
                   calibration_from_log: bool, samples: int, env_dir: Path | None, force: bool) -> None:
    """Quantize an unquantized model folder with LLM Compressor into --out, pinned; print its digest."""
    from quantize import build
    from quantize import calibration as cal

    try:
        if calibration_from_log:
            data = cal.from_request_log(load_config(config_path).database_path, samples)
        else:
            data = cal.from_file(calibration) if calibration else cal.shipped()
    except cal.CalibrationError as e:
        raise CliError(str(e)) from None
    python = _quantize_python(env_dir)
    log = out.absolute().parent / f"{out.name}.quantize.log"
    click.echo(f"quantizing {source} as {scheme} into {out} (LLM Compressor's log: {log})...", err=True)
    try:
        made = build.quantize(source, out, build.SCHEMES[scheme], python=python, calibration=data,
                              samples=samples, log=log, force=force)
    except build.BuildError as e:
        raise CliError(str(e), EXIT_FAILED) from None
    click.echo(f"built {made.description['weight_format']} ({made.total_bytes:,} bytes) in {made.folder}; "
               f"set model.path = \"{made.folder}\" and model.digest = \"{made.digest}\" to serve it", err=True)
    click.echo(made.digest)
