"""The systemd watchdog for real: the daemon (in this process, its engine a stand-in that never gets
ready) pings WATCHDOG=1 over a real NOTIFY_SOCKET from its event loop, so a wedged loop stops the pings
and systemd (WatchdogSec) would restart it; once the loop turns again the pings resume."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from itertools import pairwise
from pathlib import Path

from appliance.boot import config
from appliance.boot.assembly import build
from appliance.boot.planning import plan_for_config
from tests.support import REPO, NotifyListener, free_port, wait_for

WATCHDOG_USEC = 400_000  # pings every 0.2 s
WEDGE_S = 2.0


def _config(tmp_path: Path) -> config.Config:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((REPO / "tests/fixtures/models/qwen2.5-7b.json").read_text())
    engine = tmp_path / "never-ready-python"
    engine.write_text("#!/bin/sh\nexec sleep 300\n")  # the engine does not matter here: the loop does
    engine.chmod(0o755)
    return config.parse(f"""
[model]
path = "{model}"
[server]
host = "127.0.0.1"
port = {free_port()}
[state]
directory = "{tmp_path / 'state'}"
[engine]
python = "{engine}"
port = {free_port()}
kv_cache_memory_bytes = "1GiB"
max_model_len = 2048
stop_grace_s = 2
""")


def test_a_wedged_event_loop_stops_the_watchdog_pings_until_it_turns_again(tmp_path, monkeypatch):
    listener = NotifyListener(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", listener.path)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    cfg = _config(tmp_path)
    daemon = build(cfg, plan_for_config(cfg, ask_vllm=False))
    pings = lambda: [t for t, m in zip(listener.times, listener.messages, strict=False) if m == "WATCHDOG=1"]
    marks: dict[str, float] = {}

    def drive(loop: asyncio.AbstractEventLoop) -> None:
        try:
            wait_for(lambda: len(pings()) >= 5, 20, what="regular watchdog pings")
            marks["wedged"] = time.monotonic()
            loop.call_soon_threadsafe(time.sleep, WEDGE_S)  # a blocking call in the event loop
            before = len(pings())
            wait_for(lambda: len(pings()) >= before + 5, 20, what="the pings to resume after the wedge")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # the daemon's own handler stops it

    async def main() -> int:
        threading.Thread(target=drive, args=(asyncio.get_running_loop(),), daemon=True).start()
        return await daemon.run()

    try:
        assert asyncio.run(main()) == 0
    finally:
        listener.close()
    times = pings()
    gaps = [b - a for a, b in pairwise(times)]
    wedge_gap = max(gaps)
    assert wedge_gap >= WEDGE_S - 0.1, f"pings went on while the loop was wedged: gaps {gaps}"
    assert wedge_gap > WATCHDOG_USEC / 1e6, "systemd would not have noticed"
    at = times[gaps.index(wedge_gap)]
    assert marks["wedged"] - 0.5 <= at <= marks["wedged"] + 0.5, "the long gap is the wedge, not something else"
    others = [g for g in gaps if g is not wedge_gap]
    assert sorted(others)[len(others) // 2] < 0.35, f"pings at half WATCHDOG_USEC otherwise: {gaps}"
    assert any(m.startswith("STOPPING=1") for m in listener.messages)
