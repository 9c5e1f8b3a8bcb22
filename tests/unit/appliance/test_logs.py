"""Logging never makes the caller wait on the output, and loses nothing at exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, require_tool

CHILD = """
import logging, sys
from pathlib import Path
from appliance.runtime import logs
logs.setup("INFO")
log = logging.getLogger("t")
for i in range({n}):
    log.info("line %06d %s", i, "x" * 200)
Path(sys.argv[1]).write_text("logged")  # every call returned: the caller never waited on stderr
"""


def test_log_calls_do_not_wait_for_a_blocked_output_and_all_lines_arrive(tmp_path: Path):
    n = 5000  # about 1.2 MB: far more than a pipe holds, so a direct write would block until it is read
    marker = tmp_path / "done"
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(n=n), str(marker)], cwd=REPO,
                             stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "a log call waited for stderr to be read"
        err = child.communicate(timeout=60)[1].decode()  # now read: the writer thread drains at exit
    finally:
        child.kill()
    lines = [line for line in err.splitlines() if " t: line " in line]
    assert len(lines) == n, err[-2000:]
    assert [int(line.split(" t: line ")[1].split()[0]) for line in lines] == list(range(n))  # in order
    assert child.returncode == 0


JOURNAL_CHILD = r"""
import json, logging, os, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind("/run/systemd/journal/socket")  # journald's socket, in this process's own mount namespace
sock.settimeout(5)
os.environ["JOURNAL_STREAM"] = "8:12345"  # as systemd sets it for a service: logs go to the journal
from appliance.runtime import logs
logs.setup("INFO")
logging.getLogger("appliance.api.relay").warning("stream %s broke off: %s", "req-42", "ReadError",
                                                 extra={"REQUEST_ID": "req-42"})
logs.shutdown()
data = sock.recv(65536)
fields, i = {}, 0
while i < len(data):  # the journal's native protocol: KEY=value lines, or KEY, a 64-bit length, the value
    end = data.index(b"\n", i)
    line = data[i:end]
    if b"=" in line:
        k, v = line.split(b"=", 1)
        i = end + 1
    else:
        (n,) = struct.unpack("<Q", data[end + 1:end + 9])
        k, v = line, data[end + 9:end + 9 + n]
        i = end + 9 + n + 1
    fields[k.decode()] = v.decode()
print(json.dumps(fields))
"""


def test_under_systemd_a_request_id_becomes_a_journal_field(tmp_path: Path):
    """`journalctl REQUEST_ID=...` finds a request's lines: the field goes through the log queue and the
    journal handler to journald's socket (a socket of the test's own, in a private mount namespace)."""
    unshare = require_tool("unshare")
    script = tmp_path / "child.py"
    script.write_text(JOURNAL_CHILD)
    r = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-ec",
                        'mkdir -p /run/systemd/journal && mount -t tmpfs tmpfs /run/systemd/journal && exec "$0" "$1"',
                        sys.executable, str(script)],
                       capture_output=True, text=True, cwd=REPO, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode != 0 and "Operation not permitted" in r.stderr:
        pytest.skip(f"a private mount namespace needs root: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    fields = json.loads(r.stdout)
    assert fields["REQUEST_ID"] == "req-42", fields
    assert fields["MESSAGE"] == "stream req-42 broke off: ReadError"
    assert fields["SYSLOG_IDENTIFIER"] == "appliance" and fields["PRIORITY"] == "4"  # warning
