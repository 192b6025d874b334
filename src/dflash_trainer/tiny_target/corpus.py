"""The tiny target's corpus: the Python standard library of the running interpreter.

The split is a pure function of each file's path relative to the stdlib root, so anybody with the
same interpreter gets the same train and held-out files, and the split of a file never depends on
which other files exist:

    held_out(path)  <=>  int(sha256(relpath).hexdigest()[:8], 16) % 20 == 0     (about 5% of files)

Files under ``site-packages`` (third-party code) and files larger than ``MAX_FILE_BYTES``
(generated tables such as Unicode data) are left out; undecodable files are skipped.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_BYTES = 400_000
HELD_OUT_MODULUS = 20


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path relative to the stdlib root, e.g. "json/decoder.py"
    text: str


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % HELD_OUT_MODULUS == 0


def iter_stdlib_files(root: Path | None = None) -> list[Path]:
    """All candidate ``.py`` files under ``root``, sorted by relative path (deterministic order)."""
    return list(_stdlib_files(root or stdlib_root()))


@functools.lru_cache(maxsize=4)
def _stdlib_files(root: Path) -> tuple[Path, ...]:
    # os.walk, pruning site-packages and __pycache__ before descending into them (a Path.rglob of the
    # whole tree visited every installed package: 0.35 s against 0.03 s here, per call, and the tests
    # call it about a hundred times); symbolic links to folders are not followed, as rglob's ** does not
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "__pycache__")]
        for name in names:
            path = Path(folder) / name
            if name.endswith(".py") and path.stat().st_size <= MAX_FILE_BYTES:
                files.append(path)
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def load_split(split: str, root: Path | None = None, limit: int | None = None) -> list[SourceFile]:
    """Load the ``"train"`` or ``"held_out"`` files, in relative-path order.

    ``limit`` keeps the first ``limit`` files of the split (tests use a small, fixed subset).
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    root = root or stdlib_root()
    want_held_out = split == "held_out"
    out: list[SourceFile] = []
    for path in iter_stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        if is_held_out(rel) != want_held_out:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        out.append(SourceFile(rel, text))
        if limit is not None and len(out) >= limit:
            break
    return out
