"""The systemd units (checked by systemd-analyze) and the notify protocol on a real socket."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.runtime.systemd import Notifier, under_systemd
from tests.support import REPO, needs_tools

UNITS = REPO / "systemd"
# Documented in the README: systemd's "OK" band ends at 2.0; --threshold takes that scale x10.
SECURITY_THRESHOLD = 20

analyze = shutil.which("systemd-analyze") or "systemd-analyze"
needs_analyze = needs_tools("systemd-analyze")


def _checkable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's appliance (verify requires the binary to exist)."""
    text = (UNITS / "appliance.service").read_text()
    exe = Path(sys.executable).with_name("appliance")
    unit = tmp_path / "appliance.service"
    unit.write_text(text.replace("ExecStart=/usr/bin/appliance", f"ExecStart={exe}"))
    return unit


@needs_analyze
def test_unit_verifies_with_empty_output(tmp_path):
    r = subprocess.run([analyze, "verify", str(_checkable_unit(tmp_path))], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


@needs_analyze
def test_unit_hardening_stays_under_the_exposure_threshold(tmp_path):
    unit = _checkable_unit(tmp_path)
    r = subprocess.run([analyze, "security", "--offline=yes", f"--threshold={SECURITY_THRESHOLD}", str(unit)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:]
    # and a unit without the hardening block fails the same gate
    bare = tmp_path / "bare.service"
    bare.write_text("[Service]\nType=notify\nExecStart=/bin/true\n")
    r = subprocess.run([analyze, "security", "--offline=yes", f"--threshold={SECURITY_THRESHOLD}", str(bare)],
                       capture_output=True, text=True)
    assert r.returncode != 0


def test_unit_promises():
    text = (UNITS / "appliance.service").read_text()
    for line in ["Type=notify", "NotifyAccess=main", "WatchdogSec=", "Restart=on-failure", "StartLimitBurst=",
                 "TimeoutStartSec=15min", "User=appliance", "StateDirectory=appliance", "ConfigurationDirectory=appliance",
                 "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "NoNewPrivileges=yes",
                 "CapabilityBoundingSet=\n", "RestrictAddressFamilies=", "DevicePolicy=closed",
                 "DeviceAllow=char-nvidia* rw", "LimitNOFILE=", "ExecReload=/bin/kill -HUP $MAINPID"]:
        assert line in text, line
    assert "u appliance" in (UNITS / "appliance.sysusers.conf").read_text()
    assert "d /etc/appliance 0750 root appliance" in (UNITS / "appliance.tmpfiles.conf").read_text()
    assert "enable appliance.service" in (UNITS / "90-appliance.preset").read_text()


@pytest.fixture()
def notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    yield path, s
    s.close()


def test_notifier_speaks_the_protocol(notify_socket, monkeypatch):
    path, sock = notify_socket
    # sd_notify(3) reads NOTIFY_SOCKET from the process environment itself
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier()
    assert n.enabled and n.watchdog_interval_s == 2.0
    n.status("starting: loading model")
    n.extend_timeout(60)
    n.ready("serving")
    n.watchdog()
    n.reloading()
    n.stopping()
    got = [sock.recv(4096).decode() for _ in range(6)]
    assert got[0] == "STATUS=starting: loading model"
    assert got[1] == "EXTEND_TIMEOUT_USEC=60000000"
    assert got[2] == "READY=1\nSTATUS=serving"
    assert got[3] == "WATCHDOG=1"
    assert got[4].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert got[5].startswith("STOPPING=1")


def test_notifier_is_silent_outside_systemd():
    n = Notifier({})
    assert not n.enabled and n.watchdog_interval_s is None
    n.ready("x")  # no socket, no error
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert under_systemd({"JOURNAL_STREAM": "8:1234"}) and not under_systemd({})
