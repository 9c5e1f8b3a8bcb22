"""process_cpu_s, the benches' reading of a front's CPU: another process's whole CPU time, ended threads
included, to well under psutil's 10 ms tick."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import process_cpu_s

# Burns 0.3 s of CPU in a thread that then ends, reports what its own clock says, and waits to be read.
_CHILD = """
import sys, threading, time
def burn():
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass
t = threading.Thread(target=burn)
t.start()
t.join()
print(time.process_time(), flush=True)
sys.stdin.readline()
"""


def test_reads_another_process_whole_cpu_time_including_ended_threads() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(child.stdout.readline())  # the child's own reading, after its burning thread ended
        read = process_cpu_s(child.pid)
        assert own >= 0.3
        # The child does next to nothing between its own reading and ours: a print and a blocking read.
        assert own <= read <= own + 0.005, f"read {read:.4f} s; the child said {own:.4f} s"
    finally:
        child.communicate("\n", timeout=10)
    with pytest.raises(OSError):
        process_cpu_s(child.pid)  # ended and reaped: no clock left to read
