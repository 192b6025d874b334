"""Runs that several test files read, made once per test session and shared across files: under
pytest-xdist once for all workers (a file lock makes one worker make it while the others wait, then
all of them read it, as ``external_venvs`` does with the venvs). A shared folder is only read."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def shared(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name`` of this test session, filled by ``make(folder)`` the first time it is asked
    for (a ``make`` that raises leaves nothing behind: the next one to ask makes it again)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder that every worker's basetemp is in
    folder = root / f"shared-{name}"
    done = folder / ".done"
    with FileLock(str(folder) + ".lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            done.write_text("ok\n")
    return folder
