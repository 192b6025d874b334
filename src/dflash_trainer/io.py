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


@contextlib.contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a temporary folder next to ``final``; when the block ends without an error it replaces
    ``final`` (an existing ``final`` is removed only after the new one is complete)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
        for name in os.listdir(tmp):
            if (tmp / name).is_file():
                _fsync_path(tmp / name)
        if final.exists():
            old = final.with_name(f".{final.name}.old.{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
