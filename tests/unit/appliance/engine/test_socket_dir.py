"""The engine's private socket directory (appliance.engine.supervisor.prepare_socket_dir)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from appliance.engine.supervisor import MAX_SOCKET_DIR, prepare_socket_dir


def _short() -> Path:
    return Path(tempfile.mkdtemp(prefix="sd-"))


def test_made_private_and_a_stale_socket_removed():
    d = _short() / "engine"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    (d / "api.sock").write_text("left by a killed engine")
    assert prepare_socket_dir(d / "api.sock") == d / "api.sock"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and not (d / "api.sock").exists()


def test_a_directory_too_long_for_the_engines_sockets_is_refused_with_what_to_do():
    d = _short() / ("x" * (MAX_SOCKET_DIR + 1))
    with pytest.raises(OSError, match=r"set engine\.socket_dir to a shorter one"):
        prepare_socket_dir(d / "api.sock")
    assert not d.exists()


def test_a_directory_another_user_owns_is_not_trusted():
    d = _short() / "engine"
    d.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another user")
    os.chown(d, 65534, 65534)
    with pytest.raises(OSError, match="belongs to uid 65534"):
        prepare_socket_dir(d / "api.sock")
