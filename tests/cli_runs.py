"""``dflash-train ARGS`` run two ways, for the tests that check what a command prints and returns.

``as_process``: its own interpreter, as a user runs it. ``in_process``: ``cli.main`` in the test's
process (what the console script calls: ``sys.exit(main())``), for the further cases of a check whose
first case runs as a process: no interpreter start and import of torch and transformers per case
(2-5 s each on this machine). What a process would add to stderr is kept: every warning a real process
prints under Python's default filters is appended, so that a warning still breaks "one error line"."""

import contextlib
import io
import os
import subprocess
import sys
import warnings

from dflash_trainer.cli import main

# Python's default filters hide these outside __main__ (a real process prints the rest once per place)
QUIET = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def as_process(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def in_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``env`` is set around the call and restored after it."""
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.resetwarnings()
            warnings.simplefilter("default")
            for category in QUIET:
                warnings.simplefilter("ignore", category)
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's own usage errors
                code = exc.code
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue() + shown)


def one_thread(*args: str) -> subprocess.CompletedProcess:
    """``in_process`` at one thread, as the processes the tests start run (``OMP_NUM_THREADS=1``): a run
    compared bit for bit with theirs must sum in the same order. The thread count is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return in_process(*args)
    finally:
        torch.set_num_threads(threads)


def run(*args: str, env: dict | None = None, timeout: float = 300, process: bool = True) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``dflash-train ARGS``: ``as_process`` or, with ``process``
    false (a check's further cases), ``in_process``."""
    done = as_process(*args, env=env, timeout=timeout) if process else in_process(*args, env=env)
    return done.returncode, done.stdout, done.stderr
