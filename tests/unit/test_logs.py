"""Logging never makes the caller wait on the output, and loses nothing at exit."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support import REPO

CHILD = """
import logging, sys
from pathlib import Path
from appliance import logs
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
