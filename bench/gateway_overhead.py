"""What the appliance's gateway costs next to a reverse proxy: the same streaming chat workload sent
straight to the engine's port, through nginx, and through the appliance, interleaved in one run on
one engine.

    python bench/gateway_overhead.py [--levels 1,8,16,32] [--max-tokens 64] [--rounds 3]

The appliance runs `make run`'s configuration (dev/appliance.toml: admission on, gold reserving a
quarter of the slots) with only its ports and folders moved. Five paths per concurrency level:
  direct     the vLLM port, with the engine's key
  nginx      Debian's nginx (nginx-light), started here with a generated config: keep-alive upstream,
             no buffering. Skipped, and said so, when /usr/sbin/nginx is missing.
  floor      the least Python relay the appliance's way (bench/least_fronts.py: its engine leg and
             connection layer, none of its features), with the engine's key: what any gateway built on
             this stack costs at the least, so the appliance's CPU can be read against it as well as nginx's
  appliance  the appliance without a key: every request in the anonymous class (single-class traffic)
  classes    the appliance with keys of gold, silver and bronze in turn (admission classes in use)
With --also REF (a commit, say the change's parent), two more paths: that commit's API and the working
tree's, each built by bench/front_at.py in front of the same engine, so a change is compared with its
parent in one run (`@REF` and `@work`), with the goal: tok/s ratio and p50/p99 TTFT no worse than REF's
(within 0.02 of the ratio, 1 ms of p50, 10% of p99) and the working tree's gateway CPU per stream within
0.5 ms of the floor path's at 8 to 32 streams.
Rounds rotate the paths' order so drift in the machine hits them all; after the classes path the run waits
out gold's reserve memory (admission.reserve_memory_s), so the next path's traffic is single-class as its
name says. Prints p50/p99 time to first
token, tok/s, and per path the ratios to direct, the TTFT deltas and CPU per request of the process in
front of the engine (the appliance, the floor's, or nginx's workers), then the issue's goals, met or missed:
  tok/s ratio at least nginx's minus 0.02 at every level; p99 TTFT within 1.2x of direct while the
  load is within the engine's slots; at most 2 ms gateway CPU per streamed request (each front's idle
  cost, measured first, taken out: it is spent per second whatever the traffic; the appliance's figure
  with it is printed too); p50 TTFT at most +1 ms at one stream.
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
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
import tomli_w

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from appliance.boot import config  # noqa: E402
from appliance.engine.args import ENGINE_BASE_URL  # noqa: E402
from appliance.store import keys  # noqa: E402
from bench.least_fronts import least_splice, wait_listening  # noqa: E402
from tests.support import (  # noqa: E402
    default_model_path,
    free_port,
    launch_appliance,
    process_cpu_s,
    shared_engine_cache,
)

PROMPTS = ["Hello!", "Name a colour.", "What is 2+2?", "Say something nice.", "Capital of Italy?"]
NGINX = Path("/usr/sbin/nginx")
CLASSES = ("gold", "silver", "bronze")
CPU_GOAL_MS = 2.0  # issue 13: gateway CPU per streamed request, idle taken out


@dataclass
class Sample:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    errors: int = 0
    requests: int = 0
    cpu: float = 0.0  # CPU seconds of the process in front of the engine during this path's batches


@dataclass
class Route:
    name: str
    url: str
    headers: list[dict[str, str]]  # one per request, in turn
    front: list[psutil.Process]  # whose CPU is the path's overhead (none for direct)
    session: aiohttp.ClientSession | None = None  # its own (direct: over the engine's Unix socket)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def cpu(procs: list[psutil.Process]) -> float:
    """CPU seconds the processes have spent, read off each one's kernel CPU clock (ns; tests.support
    says why not psutil's ticks)."""
    return sum(process_cpu_s(p.pid) for p in procs)


async def one(session: aiohttp.ClientSession, path: Route, model: str, i: int, max_tokens: int, s: Sample) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, n = None, 0
    try:
        async with (path.session or session).post(path.url, json=body, headers=path.headers[i % len(path.headers)]) as r:
            if r.status != 200:
                s.errors += 1
                await r.read()
                return
            async for line in r.content:  # one token per event here
                if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                    n += 1
                    if first is None:
                        first = time.perf_counter()
    except aiohttp.ClientError:
        s.errors += 1
        return
    s.ttft.append((first or time.perf_counter()) - t0)
    s.tokens += n


async def batch(session: aiohttp.ClientSession, path: Route, model: str, start: int, n: int, conc: int,
                max_tokens: int, s: Sample) -> None:
    sem = asyncio.Semaphore(conc)

    async def guarded(i: int) -> None:
        async with sem:
            await one(session, path, model, i, max_tokens, s)

    before = cpu(path.front)
    t0 = time.perf_counter()
    await asyncio.gather(*(guarded(start + i) for i in range(n)))
    s.wall += time.perf_counter() - t0
    s.requests += n
    s.cpu += cpu(path.front) - before


def start_nginx(tmp: Path, engine_socket: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    (tmp / "nginx").mkdir()
    conf = tmp / "nginx" / "nginx.conf"
    # One worker, as the appliance is one process; buffering off so each event passes as it comes.
    # Its worker must enter the engine's private socket directory: as root, nginx's worker would otherwise
    # run as nobody.
    user = "user root;" if os.geteuid() == 0 else ""
    conf.write_text(f"""
{user}
worker_processes 1;
daemon off;
pid {tmp}/nginx/nginx.pid;
error_log {tmp}/nginx/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx/body;
    proxy_temp_path {tmp}/nginx/proxy;
    fastcgi_temp_path {tmp}/nginx/fastcgi;
    uwsgi_temp_path {tmp}/nginx/uwsgi;
    scgi_temp_path {tmp}/nginx/scgi;
    upstream engine {{ server unix:{engine_socket}; keepalive 128; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
""")
    proc = subprocess.Popen([str(NGINX), "-c", str(conf), "-p", str(tmp / "nginx")])
    try:
        wait_listening(port, 10)
    except SystemExit:
        proc.kill()
        raise SystemExit(f"nginx did not start: {(tmp / 'nginx' / 'error.log').read_text()}") from None
    return proc, port


def default_config(tmp: Path) -> Path:
    """dev/appliance.toml as `make run` uses it, with ports and folders of this run's own."""
    cfg = tomllib.loads((REPO / "dev" / "appliance.toml").read_text())
    cfg["model"]["path"] = str(default_model_path())
    cfg["server"]["port"] = free_port()
    cfg["state"]["directory"] = str(tmp / "state")
    cfg["engine"]["cache_dir"] = str(shared_engine_cache())  # compiled kernels shared with the tests
    path = tmp / "appliance.toml"
    path.write_text(tomli_w.dumps(cfg))
    return path


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    cfg_path = default_config(tmp)
    db = tmp / "state" / "appliance.db"
    db.parent.mkdir(parents=True)
    secrets = [keys.create(db, f"bench-{c}", priority_class=c)[1] for c in CLASSES]
    app = launch_appliance(cfg_path, tmp)
    nginx = None
    floor: multiprocessing.Process | None = None
    others: list[subprocess.Popen] = []  # --also's fronts
    try:
        print(f"starting the appliance on {cfg_path} (dev/appliance.toml's settings; log: {app.log_path}) ...",
              flush=True)
        app.wait_ready(900)
        slots = tomllib.loads(cfg_path.read_text())["engine"]["max_num_seqs"]
        # After the classes path, gold's reserve stays held this long: single-class traffic waits it out.
        reserve_memory_s = config.load(str(cfg_path)).admission.reserve_memory_s
        engine_key = (tmp / "state" / "engine.key").read_text().strip()
        direct_auth = [{"Authorization": f"Bearer {engine_key}"}]
        direct = aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(app.engine_socket), limit=0),
                                       timeout=aiohttp.ClientTimeout(total=600))
        paths = [Route("direct", f"{ENGINE_BASE_URL}/v1/chat/completions", direct_auth, [], direct)]
        if NGINX.exists():
            nginx, nginx_port = start_nginx(tmp, app.engine_socket)
            paths.append(Route("nginx", f"http://127.0.0.1:{nginx_port}/v1/chat/completions", direct_auth,
                               [psutil.Process(nginx.pid)]))
        else:
            print(f"nginx: {NGINX} not found (apt-get install nginx-light); that path is left out")
        floor_port = free_port()
        floor = multiprocessing.Process(target=least_splice, args=(floor_port, str(app.engine_socket)), daemon=True)
        floor.start()
        paths.append(Route("floor", f"http://127.0.0.1:{floor_port}/v1/chat/completions", direct_auth,
                           [psutil.Process(floor.pid)]))
        wait_listening(floor_port)
        for name, root in _also(args.also, tmp):
            port = free_port()
            proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "front_at.py"), str(root), str(cfg_path),
                                     str(port)], stdout=subprocess.DEVNULL)
            others.append(proc)
            wait_listening(port, 120)
            paths.append(Route(name, f"http://127.0.0.1:{port}/v1/chat/completions", [{}], [psutil.Process(proc.pid)]))
        me = [psutil.Process(app.proc.pid)]
        paths.append(Route("appliance", f"{app.url}/v1/chat/completions", [{}], me))
        paths.append(Route("classes", f"{app.url}/v1/chat/completions",
                           [{"Authorization": f"Bearer {s}"} for s in secrets], me))
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=600))
        for p in paths:  # warm every path (connections, engine caches)
            await batch(session, p, app.served_name, 0, 8, 8, args.max_tokens, Sample())
        if nginx is not None:  # its worker, which does the proxying, is there by now
            paths[1].front.extend(psutil.Process(nginx.pid).children())

        fronts = {p.name: p.front for p in paths if p.front and p.name != "classes"}
        before, t0 = {n: cpu(f) for n, f in fronts.items()}, time.perf_counter()
        await asyncio.sleep(10)
        idle = {n: 1e3 * (cpu(f) - before[n]) / (time.perf_counter() - t0) for n, f in fronts.items()}
        idle["classes"] = idle["appliance"]
        print(f"appliance idle (metrics polling, watchdog, loop monitor): {idle['appliance']:.1f} ms CPU per second"
              f"{''.join(f'; {n} {v:.1f}' for n, v in idle.items() if n not in ('appliance', 'classes'))}; "
              "cpu/req below includes it, idle/req and the goal's figure do not")
        print(f"\n{args.max_tokens} output tokens per request (greedy chat), {args.rounds} interleaved rounds, "
              f"engine slots {slots}\n")
        hdr = (f"{'streams':>7} {'path':>9} {'reqs':>5} {'ttft p50':>9} {'ttft p99':>9} {'tok/s':>8} {'err':>4} "
               f"{'cpu/req':>8} {'idle/req':>8}")
        print(hdr)
        print("-" * len(hdr))
        verdicts: list[str] = []
        floors: list[float] = []  # the floor path's CPU per request, each level
        for conc in args.levels:
            results = {p.name: Sample() for p in paths}
            per_round = max(conc, -(-max(16, 3 * conc) // args.rounds))
            for rnd in range(args.rounds):
                order = paths[rnd % len(paths):] + paths[: rnd % len(paths)]
                for p in order:
                    await batch(session, p, app.served_name, rnd * per_round, per_round, conc, args.max_tokens,
                                results[p.name])
                    if p.name == "classes":  # the next path is not single-class traffic until gold's reserve lapses
                        await asyncio.sleep(reserve_memory_s + 0.5)
            d = results["direct"]
            d_rate = d.tokens / d.wall
            # What each front's requests cost: its idle cost (per second, whatever the traffic) taken out.
            busy = {name: (1e3 * s.cpu - idle[name] * s.wall) / s.requests for name, s in results.items() if name in idle}
            for p in paths:
                s = results[p.name]
                cpu_ms = f"{1e3 * s.cpu / s.requests:.2f}ms" if p.front else "-"
                busy_ms = f"{busy[p.name]:.2f}ms" if p.name in busy else "-"
                print(f"{conc:>7} {p.name:>9} {s.requests:>5} {pct(s.ttft, 50) * 1e3:>8.1f}ms "
                      f"{pct(s.ttft, 99) * 1e3:>8.1f}ms {s.tokens / s.wall:>8.1f} {s.errors:>4} {cpu_ms:>8} {busy_ms:>8}")
            nginx_ratio = results["nginx"].tokens / results["nginx"].wall / d_rate if "nginx" in results else 1.0
            for name in [p.name for p in paths if p.name != "direct"]:
                s = results[name]
                ratio = s.tokens / s.wall / d_rate
                p50 = (pct(s.ttft, 50) - pct(d.ttft, 50)) * 1e3
                p99 = pct(s.ttft, 99) / pct(d.ttft, 99)
                print(f"{conc:>7} {name:>9} tok/s {ratio:.3f}x of direct, ttft p50 {p50:+.2f} ms, "
                      f"p99 {p99:.2f}x of direct")
                if name == "@work" and args.also:
                    verdicts.extend(_against_parent(conc, results, busy, d_rate, args.also))
                if name == "appliance":
                    verdicts.append(_goal(f"{conc:>2} streams: tok/s ratio {ratio:.3f} >= nginx's {nginx_ratio:.3f} - 0.02",
                                          ratio >= nginx_ratio - 0.02))
                    if conc <= slots:
                        verdicts.append(_goal(f"{conc:>2} streams: p99 TTFT {p99:.2f}x of direct <= 1.2x", p99 <= 1.2))
                    cpu_ms = 1e3 * s.cpu / s.requests
                    beside = "".join(f", {n} {busy[n]:.2f}" for n in ("floor", "nginx") if n in busy)
                    verdicts.append(_goal(f"{conc:>2} streams: gateway CPU {busy[name]:.2f} ms per request "
                                          f"({cpu_ms:.2f} with the idle cost{beside}) <= {CPU_GOAL_MS:g} ms",
                                          busy[name] <= CPU_GOAL_MS))
                    floors.append(busy["floor"])
                    if conc == 1:
                        verdicts.append(_goal(f" 1 stream: p50 TTFT {p50:+.2f} ms <= +1 ms", p50 <= 1.0))
            print(flush=True)
        print("goals (single-class traffic, the default configuration):")
        for v in verdicts:
            print("  " + v)
        above = [f"{c} stream{'s' if c != 1 else ''}" for c, f in zip(args.levels, floors, strict=True) if f > CPU_GOAL_MS]
        print(f"the least Python relay the appliance's way (floor) cost {', '.join(f'{f:.2f}' for f in floors)} ms per "
              f"request at {', '.join(map(str, args.levels))} streams: "
              + (f"above the {CPU_GOAL_MS:g} ms goal at {', '.join(above)}, with none of the gateway's features" if above
                 else f"within the {CPU_GOAL_MS:g} ms goal at every level"))
        await session.close()
        await direct.close()
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(10)
        if floor is not None:
            floor.kill()
        for proc in others:
            proc.kill()
        app.stop()


def _also(ref: str | None, tmp: Path) -> list[tuple[str, Path]]:
    """The fronts --also adds: REF's code (git archive, unpacked here) and the working tree's."""
    if not ref:
        return []
    root = tmp / f"code-{ref}"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return [(f"@{ref[:8]}", root), ("@work", REPO)]


def _against_parent(conc: int, results: dict[str, Sample], busy: dict[str, float], d_rate: float,
                    ref: str) -> list[str]:
    """The working tree's front against REF's, this level: no worse, within the noise allowed."""
    work, old = results["@work"], results[f"@{ref[:8]}"]
    r_work, r_old = work.tokens / work.wall / d_rate, old.tokens / old.wall / d_rate
    p50 = (pct(work.ttft, 50) - pct(old.ttft, 50)) * 1e3
    p99 = pct(work.ttft, 99) / pct(old.ttft, 99)
    out = [_goal(f"{conc:>2} streams: tok/s ratio {r_work:.3f} vs {ref[:8]}'s {r_old:.3f} (>= it - 0.02)",
                 r_work >= r_old - 0.02),
           _goal(f"{conc:>2} streams: p50 TTFT {p50:+.2f} ms vs {ref[:8]}'s (<= +1 ms)", p50 <= 1.0),
           _goal(f"{conc:>2} streams: p99 TTFT {p99:.2f}x {ref[:8]}'s (<= 1.1x)", p99 <= 1.1)]
    if conc >= 8:
        gap = busy["@work"] - busy["floor"]
        out.append(_goal(f"{conc:>2} streams: gateway CPU {busy['@work']:.2f} ms per stream, {gap:+.2f} ms from the "
                         f"floor's {busy['floor']:.2f} ({ref[:8]}: {busy[f'@{ref[:8]}']:.2f}) (<= +0.5 ms)", gap <= 0.5))
    return out


def _goal(what: str, met: bool) -> str:
    return f"{what}: {'met' if met else 'MISSED'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--also", metavar="REF", help="also REF's API and the working tree's, in front of the same engine")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
