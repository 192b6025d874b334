"""The scripts of tests/external run in their separate venvs (``external_venvs``) through one long-lived
interpreter per venv and test process (tests/external/serve.py): starting a python that imports torch,
transformers and speculators costs seconds of CPU each time, and the parity files ran a dozen such
launches. The scripts and their inputs are the same as with ``python SCRIPT ARGS``: the interpreter is
the venv's, started with PYTHONPATH empty (nothing of dflash_trainer in there) and HF_HUB_OFFLINE=1.
"""

import atexit
import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path

EXTERNAL = Path(__file__).resolve().parent / "external"
_SERVERS: dict[str, tuple[subprocess.Popen, Path]] = {}


def _server(python: Path) -> tuple[subprocess.Popen, Path]:
    key = str(python)
    if key in _SERVERS and _SERVERS[key][0].poll() is None:
        return _SERVERS[key]
    log = Path(tempfile.mkstemp(prefix="external-serve-", suffix=".log")[1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}  # nothing of dflash_trainer in there
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [key, str(EXTERNAL / "serve.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    _SERVERS[key] = (proc, log)
    return proc, log


def _stop(proc: subprocess.Popen, log: Path) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.unlink(missing_ok=True)


@atexit.register
def _stop_all() -> None:
    for proc, log in _SERVERS.values():
        _stop(proc, log)
    _SERVERS.clear()


def run_script(python: Path, script: str, *args, cwd: Path | None = None, timeout: float = 900) -> str:
    """``python tests/external/SCRIPT ARGS...`` in ``cwd``, in the venv of ``python``; asserts that it
    succeeded (the message holds its output and traceback) and returns what it printed."""
    proc, log = _server(python)
    request = {"script": str(EXTERNAL / script), "args": [str(a) for a in args], "cwd": str(cwd or os.getcwd())}
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    deadline = time.monotonic() + timeout
    while not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError(f"{script} did not finish in {timeout} s")
    line = proc.stdout.readline()
    if not line:  # the interpreter died (a crash in C code)
        proc.wait()
        raise AssertionError(f"{script}: {python} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    reply = json.loads(line)
    assert reply["ok"], f"{script} failed:\n{reply['output'][-3000:]}"
    return reply["output"]
