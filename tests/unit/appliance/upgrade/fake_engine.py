"""A stand-in for vLLM's API server, started by a fake interpreter (`fake-python -m ... --model M --uds S`):
it serves /health and greedy chat answers on the socket, as the model folder says:

    M/answer.txt   the text of every chat answer
    M/exit-at-once present: exit with status 3 before serving (an engine that cannot start)
    M/die-after    seconds after becoming healthy to exit with status 4 (an engine that dies in service)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import UnixStreamServer


def arg(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


class Handler(BaseHTTPRequestHandler):
    answer = ""

    def log_message(self, *args: object) -> None:
        pass

    def address_string(self) -> str:
        return "engine"

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._send({"choices": [{"index": 0, "message": {"role": "assistant", "content": Handler.answer}}]})


class UnixHTTPServer(UnixStreamServer, HTTPServer):
    def server_bind(self) -> None:
        UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "engine", 0


def main() -> None:
    model, sock = Path(arg("--model")), arg("--uds")
    if (model / "exit-at-once").exists():
        print("engine: cannot start", flush=True)
        sys.exit(3)
    Handler.answer = (model / "answer.txt").read_text() if (model / "answer.txt").exists() else "ok"
    if os.path.exists(sock):
        os.unlink(sock)
    server = UnixHTTPServer(sock, Handler)
    die = model / "die-after"
    if die.exists():
        delay = float(die.read_text())
        threading.Thread(target=lambda: (time.sleep(delay), os._exit(4)), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
