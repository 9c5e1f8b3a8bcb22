"""The engine answers the appliance alone (issue 15): no TCP port, and its Unix sockets in a directory
no other local account can enter.

vLLM's key check covers only some routes (/v1, /v2, /inference, /cohere); `/invocations` generates for
anyone who reaches the port. So the test is not "which routes refuse" but "who can connect at all".
"""

from __future__ import annotations

import os
import socket
import stat

import psutil
import pytest

from tests.support import RunningAppliance

pytestmark = pytest.mark.engine

def _connect_as_nobody(path: str) -> str:
    """Connect to `path` from a child that has become nobody (no program run: the child only makes system
    calls, so no interpreter has to be readable by that account), and send /invocations, vLLM's unguarded
    generation route. What happened, as text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, try, report, leave without running Python's exit handlers
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(b"POST /invocations HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 2\r\n\r\n{}")
                msg = b"CONNECTED " + s.recv(200)
        except OSError as e:
            msg = f"{type(e).__name__} {e.errno}".encode()
        os.write(w, msg)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return out


def test_the_engine_listens_on_no_tcp_port(appliance: RunningAppliance):
    engine = appliance.engine_processes()
    assert engine, "no engine processes found"
    listening = [(p.pid, c.laddr) for p in engine for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr)]  # 2: UDP
    assert listening == [], f"the engine listens on TCP/UDP: {listening}"
    # Its named Unix sockets (the API's and vLLM's own ZeroMQ ones) are all in the private directory.
    private = appliance.engine_socket.parent
    named = {c.laddr for p in engine for c in p.net_connections(kind="unix") if c.laddr and c.laddr[0] == "/"}
    # The configured path links to the serving engine's own socket (two run during an upgrade's beside swap).
    assert appliance.engine_socket.is_symlink() and str(appliance.engine_socket.resolve()) in named
    assert all(os.path.dirname(path) == str(private) for path in named), named


def test_only_the_service_user_can_enter_the_socket_directory(appliance: RunningAppliance):
    d = appliance.engine_socket.parent
    st = d.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    # The appliance itself gets through (the route answers as vLLM does, with the internal key refused).
    assert appliance.engine_get("/health", timeout=10).status_code == 200
    if os.geteuid() != 0:
        return  # cannot become another account to try; the mode above is what keeps one out
    out = _connect_as_nobody(str(appliance.engine_socket))
    assert out == "PermissionError 13", f"another account reached the engine: {out}"
