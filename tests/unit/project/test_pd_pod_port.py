"""A regional pod whose port another process bound first starts again on another (tests/pd_cluster.py).

The pod is a few lines of http.server in place of vLLM: what is checked is the start and its retry, which do
not care what serves /health; the real pods start in tests/integration/test_cascade.py."""

from __future__ import annotations

import socket
import sys

import pytest

from tests import loopback, pd_cluster
from tests.support import free_port

POD = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class StandInPod(pd_cluster.VllmServer):
    COMMAND = (sys.executable, "-c", POD)


@pytest.fixture
def taken_port(monkeypatch, tmp_path):
    """A port that another socket listens on, handed to the pod's first start."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        picks = iter([port])
        monkeypatch.setattr(pd_cluster, "free_port", lambda: next(picks, None) or free_port())
        monkeypatch.setattr(pd_cluster, "default_model_path", lambda: tmp_path)
        yield port


def test_a_pod_whose_port_was_taken_starts_again_on_another(tmp_path, taken_port):
    pod = StandInPod(tmp_path, "kv_consumer", tmp_path / "kv", "regional")
    try:
        pod.wait_ready(timeout=30)
        assert pod.port != taken_port
        assert loopback.get(f"{pod.url}/health", timeout=5).status_code == 200
        assert f"port {taken_port} was taken" in pod.log_text()
    finally:
        pod.stop()


def test_a_pod_that_fails_for_another_reason_is_not_started_again(tmp_path, monkeypatch):
    monkeypatch.setattr(pd_cluster, "default_model_path", lambda: tmp_path)

    class Broken(pd_cluster.VllmServer):
        COMMAND = (sys.executable, "-c", "raise SystemExit('no model here')")

    pod = Broken(tmp_path, "kv_consumer", tmp_path / "kv", "regional")
    try:
        with pytest.raises(AssertionError, match="no model here"):
            pod.wait_ready(timeout=30)
        assert "was taken" not in pod.log_text()
    finally:
        pod.stop()
