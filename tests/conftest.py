"""Session fixtures: one real appliance (real vLLM CPU engine) shared by the API tests."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from tests import loopback, pd_cluster
from tests.support import RUNNING, RunningAppliance, other_threads, sockets, start_appliance, state_dump

pytest_plugins = ["pytester"]  # tests/unit/project/test_ci_runs_everything.py runs pytest on small test files

DAEMON_LINES, ENGINE_LINES, DUMP_LINES = 60, 15, 400
GLANCE_LINES, GLANCE_WIDTH = 25, 300  # of each failure's message, in the summary before FAILURES
ENGINE_LOGGER = " appliance.engine.vllm: "  # the engine's own output, relayed: verbose, so fewer of its lines


def under_ci() -> bool:
    """CI sets CI=true. There every test must run: a skip for a missing tool, package or privilege hides
    exactly the missing install step a fresh machine would hit."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _fail_skip_under_ci(report) -> None:
    if under_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true, where every test must run (`make test` installs what the "
                           f"suite needs): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped at collection (importorskip, a module-level skip) fails under CI too."""
    outcome = yield
    _fail_skip_under_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI a skip is a failure that names what was missing. A failed test's report carries the tail
    of every live appliance's log (the daemon's side of it)."""
    outcome = yield
    report = outcome.get_result()
    _fail_skip_under_ci(report)
    if report.failed and RUNNING:
        report.sections.append(("machine", _machine_load()))
        report.sections.append(("who had the CPUs", _cpu_shares()))
        report.sections.append(("this test process's other threads", other_threads()))
    if report.failed:
        for app in RUNNING:
            try:
                lines = app.log_text().splitlines()
            except OSError as e:
                lines = [f"(log unreadable: {e})"]
            daemon = [line for line in lines if ENGINE_LOGGER not in line][-DAEMON_LINES:]
            engine = [line for line in lines if ENGINE_LOGGER in line][-ENGINE_LINES:]
            report.sections.append((f"appliance log: {app.log_path} (daemon)", "\n".join(daemon)))
            report.sections.append((f"appliance log: {app.log_path} (engine)", "\n".join(engine)))
            # after the tails, which the dump would otherwise fill
            report.sections.append((f"appliance {app.url}: its sockets", sockets(app)))
            report.sections.append((f"appliance {app.url}: state dump", _state_dump(app)))
        for server in pd_cluster.SERVERS:
            report.sections.append((f"regional vLLM {server.role}: {server.log_path}", server.log_tail(ENGINE_LINES)))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session) -> None:
    """Every failure's own message, a few lines each, before pytest's FAILURES section: that section puts
    the first failure's logs and dumps ahead of the rest, and a CI summary that shows only the start of it
    showed one failure of two, the other's message lost."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    failed = [] if reporter is None else reporter.stats.get("failed", []) + reporter.stats.get("error", [])
    if not failed:
        return
    reporter.write("\n")  # the progress line has no newline of its own yet
    reporter.write_sep("=", f"failures at a glance ({len(failed)}; each one's logs follow under FAILURES)")
    for report in failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        reporter.write_line(f"{report.nodeid} ({report.when}):")
        lines = message.splitlines()
        for line in lines[:GLANCE_LINES]:
            reporter.write_line(f"    {line[:GLANCE_WIDTH]}")
        if len(lines) > GLANCE_LINES:
            reporter.write_line(f"    ... {len(lines) - GLANCE_LINES} more lines under FAILURES")


def _state_dump(app: RunningAppliance) -> str:
    """The daemon's requests in flight, tasks and threads (SIGUSR1), cut to DUMP_LINES."""
    if app.proc.poll() is not None:
        return f"(exited with {app.proc.returncode})"
    dump = state_dump(app)
    if dump is None:
        return "(no state dump within 10 s: the daemon's event loop did not run the handler)"
    return "\n".join(dump.splitlines()[:DUMP_LINES])


def _machine_load() -> str:
    """How busy the box was when the test failed: a starved machine reads like a slow appliance."""
    lines = []
    for path in ("/proc/loadavg", "/proc/pressure/cpu", "/proc/pressure/memory", "/proc/pressure/io"):
        try:
            lines += [f"{path}: {line}" for line in Path(path).read_text().splitlines()]
        except OSError:
            pass
    return "\n".join(lines) or "(no load figures on this system)"


def _cpu_shares() -> str:
    """For this test process, each live appliance and their children: the CPU each has had and how long its
    threads waited for one (the kernel's schedstat), since each started. A test process that waited minutes
    for a CPU reads like an appliance that answered slowly; these figures tell the two apart."""
    import psutil

    procs = [psutil.Process()]
    for app in RUNNING:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(app.proc.pid)
            procs += [parent, *parent.children(recursive=True)]
    lines = ["pid, what: seconds on a CPU / waiting for one (its threads alive now) / alive"]
    for proc in procs:
        try:
            on, waited = 0, 0
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                fields = (task / "schedstat").read_text().split()
                on, waited = on + int(fields[0]), waited + int(fields[1])
            name = " ".join(proc.cmdline()[:4])[:100]
            alive = time.time() - proc.create_time()
        except (OSError, ValueError, IndexError, psutil.Error):
            continue  # gone meanwhile, or no schedstat on this kernel
        lines.append(f"{proc.pid}, {name}: {on / 1e9:.1f} / {waited / 1e9:.1f} / {alive:.0f}")
    return "\n".join(lines)


@pytest.fixture(scope="session")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> RunningAppliance:
    running = start_appliance(tmp_path_factory.mktemp("appliance"))
    try:
        running.wait_ready()
    except BaseException:
        running.stop()
        raise
    yield running
    running.stop()


@pytest.fixture()
def oai(appliance: RunningAppliance):
    import openai

    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=120,
                         http_client=loopback.client())
