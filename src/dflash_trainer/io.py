"""The one way this project writes files: atomically (temporary name, fsync, rename), plus sha256.

A reader never sees half a file or half a folder: ``OUT`` is either the old content or the new.
Temporary names start with a dot and sit next to the destination (same file system, so the rename
is atomic); they are removed when the write fails. Files get the usual permissions (umask), not
``mkstemp``'s private 0600: reports and checkpoints are meant to be shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[str], None]) -> Path:
    """``write(tmp_path)`` writes the content to a temporary file next to ``path``, then it is renamed
    to ``path``. On any failure the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_write_json(path: Path, obj) -> Path:
    """Write ``obj`` as indented JSON plus a newline to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_dead_folders(final: Path) -> list[Path]:
    """The temporary folders of ``atomic_folder(final)`` whose writer is dead (a killed process leaves
    its ``.NAME.PID.*`` folder behind; a later write of ``final`` removes it). A live writer's folder is
    left alone. Names carry the pid of the writer on this machine: on a file system shared between
    machines, a pid alive here may be another machine's dead writer, whose folder is then kept."""
    gone = []
    for p in Path(final).parent.glob(f".{Path(final).name}.*"):
        pid = p.name[len(Path(final).name) + 2 :].split(".")[0]
        if pid.isdigit() and p.is_dir() and not p.is_symlink() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a temporary folder next to ``final``; when the block ends without an error it replaces
    ``final`` (an existing ``final`` is removed only after the new one is complete). Folders that killed
    writers of ``final`` left behind are removed first."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_folders(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        for name in os.listdir(tmp):
            if (tmp / name).is_file():
                _fsync_path(tmp / name)
        if final.exists():
            old = final.with_name(f".{final.name}.{os.getpid()}.old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
