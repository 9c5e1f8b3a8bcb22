"""The quantizing environment: a virtual environment of its own holding LLM Compressor, set up on demand.

LLM Compressor 0.14 pins compressed-tensors 0.19 and transformers <= 5.17, and vLLM's CPU build 0.32 pins
compressed-tensors 0.17: installed into the engine's environment one breaks the other's pin (the
checkpoints it writes load fine in the engine). So it gets its own environment, the way the engine has
its own, and neither the daemon nor the engine carries its pins. Its torch is the engine's own version, so
both read and write tensors the same way (and pip finds the same CPU or CUDA build).
"""

from __future__ import annotations

import os
import subprocess
import venv
from importlib import metadata
from pathlib import Path

# The versions the suite quantized with (tests/integration/test_quantized_*.py); a change here is a change
# of the builds a fleet pins, so it goes with those tests.
PINS = ("llmcompressor==0.14.0", "compressed-tensors==0.19.0", "transformers==5.17.0", "accelerate==1.15.0",
        "datasets==5.0.1")
_STAMP = ".appliance-quantize-pins"


class QuantizeEnvError(RuntimeError):
    """The quantizing environment could not be set up; the message says what to do."""


def default_dir() -> Path:
    env = os.environ.get("APPLIANCE_QUANTIZE_ENV")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "appliance" / "quantize-env"


def requirements() -> list[str]:
    """The pins, with torch held to the engine's version (this process runs in the engine's environment)."""
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise QuantizeEnvError("torch is not installed beside the appliance: run `make setup` (the engine's "
                               "environment) before quantizing") from None
    return [*PINS, f"torch=={torch}"]


def python_of(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def is_ready(env_dir: Path) -> bool:
    stamp = env_dir / _STAMP
    return python_of(env_dir).exists() and stamp.is_file() and stamp.read_text().split() == requirements()


def ensure(env_dir: Path, log: Path) -> Path:
    """The environment's python, created (or brought to the pins) first where needed; pip's output goes
    to log. Returns at once when the environment already holds exactly these pins."""
    if is_ready(env_dir):
        return python_of(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    if not python_of(env_dir).exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    wanted = requirements()
    with log.open("a") as out:
        done = subprocess.run([str(python_of(env_dir)), "-m", "pip", "install", "--disable-pip-version-check",
                               *wanted], stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise QuantizeEnvError(f"installing LLM Compressor into {env_dir} failed (pip exit {done.returncode}); "
                               f"pip's output is in {log}. It needs the package index (or a local mirror) "
                               f"once; set APPLIANCE_QUANTIZE_ENV to use another folder")
    (env_dir / _STAMP).write_text("\n".join(wanted) + "\n")
    return python_of(env_dir)
