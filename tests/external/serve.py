"""Run inside a separate venv (tests/external_runner.py starts it): run the scripts of this folder one
after another in this one interpreter, so that torch, transformers and the writer's package are
imported once per test process instead of once per script (seconds each).

    python serve.py

Requests come on stdin, one JSON line each: ``{"script": FILE, "args": [...], "cwd": DIR}``; the script
runs as ``python FILE ARGS...`` would run it (``__main__``, ``sys.argv``, ``sys.path[0]``, the working
folder). Each reply is one JSON line on the original stdout: ``{"ok": bool, "output": str}``, ``ok``
false when the script raised or exited non-zero, ``output`` what it printed (and the traceback).
Nothing from dflash_trainer is imported here.
"""

import contextlib
import gc
import io
import json
import os
import runpy
import sys
import traceback


def run(request: dict) -> dict:
    output, ok = io.StringIO(), True
    argv, path0, cwd = sys.argv, sys.path[0], os.getcwd()
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
    try:
        os.chdir(request["cwd"])
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exc:
        ok = exc.code in (None, 0)
        output.write(f"SystemExit: {exc.code}\n")
    except BaseException:
        ok = False
        output.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[0] = argv, path0
        os.chdir(cwd)
        gc.collect()  # the script's namespace and what it built: its functions' globals make a cycle
        # What is left (the imported torch, transformers and the writer's package) stays: frozen out of
        # every later collection, which would walk it again after each script (12 scripts in one
        # process: 5.25 of its 26.7 CPU-s were collections, 1.93 of 23.8 frozen; measured 2026-12-07)
        gc.freeze()
    return {"ok": ok, "output": output.getvalue()[-20000:]}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what C code prints goes to stderr, never into the replies
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(run(json.loads(line))) + "\n")
            replies.flush()


if __name__ == "__main__":
    main()
