"""``DFLASH_TEST_CPU_REPORT=FILE pytest ...``: what each test costs in CPU seconds, its own and its
subprocesses'.

Under ``-n 3`` on 2 cores the suite is CPU-bound (about 1.9 cores busy on average), so wall-clock
durations (``--durations``) are inflated by whatever else runs at the same moment, and a test that spends
its time in a ``dflash-train`` process, a torchrun launch or a vLLM engine shows almost nothing of it in
its own worker. This plugin records, per test (setup, call and teardown together: a module fixture's
cost lands on the first test that uses it), the worker's CPU time (``time.process_time``, every thread)
and its reaped children's (``RUSAGE_CHILDREN``: every subprocess the test started and waited for, with
the processes those waited for), one JSON line per test in FILE; the process that starts the session
then prints the files and tests that cost most. What no test waited for (a server killed without being
reaped, a grandchild left behind) is not counted: the report prints the run's total next to the sum.
An environment variable, not a pytest option: the xdist workers parse the command line before they
load this folder's conftest.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path

import pytest

ENV = "DFLASH_TEST_CPU_REPORT"


def _report_path() -> str | None:
    return os.environ.get(ENV) or None


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def pytest_sessionstart(session):
    path = _report_path()
    if path and not hasattr(session.config, "workerinput"):  # the controller (or the only process)
        Path(path).write_text("")
        session.config._cpu_report_start = (time.monotonic(), os.times())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = _report_path()
    if not path:
        yield
        return
    own, children, wall = time.process_time(), _children_cpu(), time.monotonic()
    yield
    record = {
        "test": item.nodeid,
        "own_cpu_s": round(time.process_time() - own, 3),
        "subprocess_cpu_s": round(_children_cpu() - children, 3),
        "wall_s": round(time.monotonic() - wall, 3),
    }
    with open(path, "a") as f:  # one short line per write: appends from the workers do not interleave
        f.write(json.dumps(record) + "\n")


def summarize(records: list[dict], top: int = 15) -> list[str]:
    """The report's lines: the ``top`` files and tests by CPU seconds (own + subprocesses)."""
    cost = lambda r: r["own_cpu_s"] + r["subprocess_cpu_s"]  # noqa: E731
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in records:
        f = files[r["test"].split("::")[0]]
        f[0] += r["own_cpu_s"]
        f[1] += r["subprocess_cpu_s"]
    total = sum(map(cost, records))
    lines = [f"CPU seconds of {len(records)} tests: {total:,.0f} (own + subprocesses)", "files:"]
    for name, (own, sub) in sorted(files.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {own + sub:7.1f}  (own {own:6.1f}, subprocesses {sub:6.1f})  {name}")
    lines.append("tests:")
    for r in sorted(records, key=cost, reverse=True)[:top]:
        lines.append(
            f"  {cost(r):7.1f}  (own {r['own_cpu_s']:6.1f}, subprocesses {r['subprocess_cpu_s']:6.1f})  {r['test']}"
        )
    return lines


def pytest_terminal_summary(terminalreporter, config):
    path = _report_path()
    if not path or hasattr(config, "workerinput") or not Path(path).is_file():
        return
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    terminalreporter.section(f"CPU seconds per test ({ENV})")
    for line in summarize(records):
        terminalreporter.write_line(line)
    start = getattr(config, "_cpu_report_start", None)
    if start is not None:
        t0, cpu0 = start
        now = os.times()
        run_cpu = sum(now[:4]) - sum(cpu0[:4])  # this process and every child it reaped (the xdist workers)
        terminalreporter.write_line(
            f"the whole run so far: {time.monotonic() - t0:,.0f} s wall, {run_cpu:,.0f} CPU s in this process "
            f"and its reaped children ({run_cpu / max(1e-9, time.monotonic() - t0):.2f} cores busy on average)"
        )
