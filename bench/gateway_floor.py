"""What relaying a stream costs in CPU on this machine, with the engine's own cost taken out: nginx, the
least a Python relay can do (two ways), and the appliance's gateway, side by side against one stand-in engine.

    python bench/gateway_floor.py [--requests 400] [--concurrency 16] [--rounds 3] [--events 64] [--granian]

bench/gateway_overhead.py measures the real engine; there the engine's CPU drowns the front's and the
runs are slow. Here a child process answers every chat request with 64 vLLM-shaped SSE events 10 ms
apart, the usage event and [DONE] (an engine step per event, as the CPU engine sends them), and four
fronts relay it, rounds interleaved:
  nginx      Debian's nginx-light, the same generated config as gateway_overhead.py (left out when missing)
  relay      a raw ASGI app on uvicorn reading the engine over aiohttp, nothing else: the floor of a
             Python front that passes every chunk through an HTTP client and ASGI's send
  splice     the least relay the appliance's way (appliance.api.splice): EngineStream for the engine leg,
             each chunk written by the connection layer's ClientWriter, on the daemon's uvicorn setup
  appliance  the appliance's own app built from make run's configuration (dev/appliance.toml: keys,
             admission, request log, metrics), its engine marked ready at the stand-in's address, served
             as the daemon serves it
  --granian  also the relay and the appliance served by granian (a Rust HTTP server; `pip install granian`,
             not a dependency): does another server layer lower the cost? (bench/granian_targets.py)
Prints each front's CPU per request (user + system, the front's process only), its ratio to nginx's,
and the gap between the appliance and the splice floor: what the gateway's own features cost per stream.
Each front's idle CPU (the appliance's metrics polling, watchdog and loop monitor; a server's timers) is
measured for --idle seconds first and taken out of its figures, as gateway_overhead.py does; the figures
with it are printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from appliance.boot import config  # noqa: E402
from appliance.engine.args import ENGINE_BASE_URL  # noqa: E402
from appliance.engine.supervisor import prepare_socket_dir  # noqa: E402
from bench.gateway_overhead import NGINX, cpu, default_config, start_nginx  # noqa: E402
from bench.least_fronts import least_relay, least_splice, wait_listening  # noqa: E402
from bench.stand_in import serve_sse  # noqa: E402
from tests.support import free_port  # noqa: E402

EVENTS = 64
EVENT = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
         b'"delta":{"content":" the"},"logprobs":null,"finish_reason":null}]}\n\n')
USAGE = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":5,"completion_tokens":64,"total_tokens":69}}\n\n')


def stand_in_engine(path: str, events: int = EVENTS) -> None:
    serve_sse(path, "/v1/chat/completions", EVENT, events, 0.01, USAGE + b"data: [DONE]\n\n")


def appliance_gateway(port: int, tmp: str) -> None:
    """The daemon's app as assembly.build makes it, served as the daemon serves it, minus the engine."""
    import uvicorn
    import uvloop

    from appliance.boot import config
    from appliance.boot.assembly import build
    from appliance.boot.planning import plan_for_config
    from appliance.engine.supervisor import EngineState
    from appliance.runtime.daemon import server_config

    cfg = config.load(str(default_config(Path(tmp))))
    daemon = build(cfg, plan_for_config(cfg, ask_vllm=False))
    daemon.supervisor.status.state = EngineState.READY
    daemon.supervisor.launch = SimpleNamespace(base_url=ENGINE_BASE_URL)  # type: ignore[assignment]
    cfg.state.directory.mkdir(parents=True, exist_ok=True)
    daemon.request_log.start()
    cfg.server.host, cfg.server.port = "127.0.0.1", port
    uvloop.run(uvicorn.Server(server_config(daemon.app, cfg.server)).serve())


async def load(port: int, requests: int, concurrency: int, expect: int = EVENTS) -> int:
    """Stream `requests` chat answers through the front; returns how many failed."""
    body = b'{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"hi"}],"stream":true}'
    failed = 0
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one() -> None:
            nonlocal failed
            async with sem, s.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                   headers={"content-type": "application/json"}) as r:
                events = 0
                async for line in r.content:
                    events += line.startswith(b"data: {")
                failed += r.status != 200 or events < expect

        await asyncio.gather(*(one() for _ in range(requests)))
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=EVENTS,
                    help="events per answer; --events 1 leaves mostly the per-request cost")
    ap.add_argument("--granian", action="store_true", help="also serve the relay and the appliance with granian")
    ap.add_argument("--idle", type=float, default=10, help="seconds each front's idle CPU is measured over")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    # The stand-in listens where the appliance's configuration puts the engine's socket, as the real one does.
    engine_socket = prepare_socket_dir(config.load(str(default_config(tmp))).engine_socket)
    children = [multiprocessing.Process(target=stand_in_engine, args=(str(engine_socket), args.events), daemon=True)]
    fronts: dict[str, tuple[int, list[psutil.Process]]] = {}
    relay_port, splice_port, gw_port = free_port(), free_port(), free_port()
    children.append(multiprocessing.Process(target=least_relay, args=(relay_port, str(engine_socket)), daemon=True))
    children.append(multiprocessing.Process(target=least_splice, args=(splice_port, str(engine_socket)), daemon=True))
    children.append(multiprocessing.Process(target=appliance_gateway, args=(gw_port, str(tmp)),
                                            daemon=True))
    for c in children:
        c.start()
    nginx = None
    if NGINX.exists():
        nginx, nginx_port = start_nginx(tmp, engine_socket)
        workers = psutil.Process(nginx.pid).children() or [psutil.Process(nginx.pid)]
        fronts["nginx"] = (nginx_port, workers)
    else:
        print(f"nginx: {NGINX} not found (apt-get install nginx-light); that front is left out")
    fronts["relay"] = (relay_port, [psutil.Process(children[1].pid)])
    fronts["splice"] = (splice_port, [psutil.Process(children[2].pid)])
    fronts["appliance"] = (gw_port, [psutil.Process(children[3].pid)])
    granians = start_granians(engine_socket, tmp, fronts) if args.granian else []
    try:
        for port, _ in fronts.values():
            wait_listening(port)
        for port, _ in fronts.values():  # warm before the idle reading: connections open, code paths hot
            asyncio.run(load(port, 20, args.concurrency, args.events))
        idle_before = {name: cpu(procs) for name, (_, procs) in fronts.items()}
        t0 = time.perf_counter()
        time.sleep(args.idle)
        idle_ms_per_s = {name: 1e3 * (cpu(procs) - idle_before[name]) / (time.perf_counter() - t0)
                         for name, (_, procs) in fronts.items()}
        per_request: dict[str, list[float]] = {name: [] for name in fronts}
        with_idle: dict[str, list[float]] = {name: [] for name in fronts}
        for rnd in range(args.rounds):
            order = list(fronts) if rnd % 2 == 0 else list(reversed(fronts))
            for name in order:
                port, procs = fronts[name]
                asyncio.run(load(port, 20, args.concurrency, args.events))  # warm: connections open, code paths hot
                before, t0 = cpu(procs), time.perf_counter()
                failed = asyncio.run(load(port, args.requests, args.concurrency, args.events))
                if failed:
                    raise SystemExit(f"{name}: {failed} of {args.requests} streams failed or came short")
                spent_ms, wall = 1e3 * (cpu(procs) - before), time.perf_counter() - t0
                with_idle[name].append(spent_ms / args.requests)
                per_request[name].append((spent_ms - idle_ms_per_s[name] * wall) / args.requests)
        print(f"CPU per streamed request ({args.events} events, {args.concurrency} streams, {args.rounds} rounds "
              f"of {args.requests}; median of rounds; idle CPU taken out)")
        med = {n: sorted(v)[len(v) // 2] for n, v in per_request.items()}
        for name, v in per_request.items():
            vs = f"  {med[name] / med['nginx']:.2f}x nginx" if "nginx" in med else ""
            print(f"  {name:10} {med[name]:6.2f} ms   rounds {', '.join(f'{x:.2f}' for x in v)}{vs}   "
                  f"(idle {idle_ms_per_s[name]:.1f} ms/s; with it {sorted(with_idle[name])[len(v) // 2]:.2f} ms)")
        print(f"  the gateway's own features cost {med['appliance'] - med['splice']:.2f} ms per stream over the "
              f"least relay its way (splice); the least ASGI relay costs {med['relay'] - med['splice']:.2f} ms more "
              "than that")
    finally:
        if nginx is not None:
            nginx.terminate()
        for c in children:
            c.kill()
        for g in granians:
            g.terminate()


def start_granians(engine_socket: Path, tmp: Path, fronts: dict) -> list[subprocess.Popen]:
    """granian serving bench/granian_targets.py's relay and appliance, added to `fronts` (its process tree)."""
    import importlib.util

    if importlib.util.find_spec("granian") is None:
        raise SystemExit("--granian: granian is not installed (pip install granian)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               ENGINE_SOCKET=str(engine_socket), APPLIANCE_TMP=str(tmp))
    started = []
    for name, target in (("granian-relay", ["--factory", "bench.granian_targets:relay"]),
                         ("granian-appl", ["--factory", "bench.granian_targets:appliance"])):
        port = free_port()
        g = subprocess.Popen([sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
                              "--port", str(port), "--workers", "1", "--loop", "uvloop", "--no-ws",
                              "--log-level", "warning", *target], env=env)
        started.append(g)
        wait_listening(port)
        fronts[name] = (port, [psutil.Process(g.pid), *psutil.Process(g.pid).children(recursive=True)])
    return started


if __name__ == "__main__":
    main()
