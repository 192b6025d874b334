"""Where records come from: local files in the formats users' data comes in, read incrementally.

A data path is one of:

- a ``.jsonl`` file: one JSON value per line, lines numbered from 1 (blank lines are not records);
  lines end at LF only, except in a file without any LF, whose lines end at CR (old Mac OS endings);
- a ``.parquet`` file, or an ``.arrow`` file (Arrow IPC, file or stream format: ``datasets`` writes the
  stream format): one record per table row, rows numbered from 1 (reported as the record's line);
- a folder written by ``datasets``' ``save_to_disk`` (``state.json`` + ``data-*.arrow``): its files in
  the order ``state.json`` lists them; a saved ``DatasetDict`` (``dataset_dict.json``): its ``train``
  split (name another split's subfolder to read that one);
- a ``datasets`` cache folder (``dataset_info.json`` + ``<name>-<split>[-NNNNN-of-NNNNN].arrow``): its
  ``train`` files, or a Hub name (``org/name``) whose copy is in the local ``datasets`` cache
  (``$HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``, else ``~/.cache/huggingface/datasets``). Nothing
  is downloaded: a Hub name without a local copy is one line that says how to get one;
- any other folder: every ``.jsonl``, ``.parquet`` and ``.arrow`` file under it, sorted.

Nothing reads a whole file: JSONL is read line by line with a bounded line length (a longer line is
skipped without being held in memory), tables batch by batch. Data paths that are not regular files
(a FIFO, a device, a broken link) are refused before anything is opened.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = (".jsonl", *TABLE_SUFFIXES)
_BOM = b"\xef\xbb\xbf"
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TABLE_BATCH_ROWS = 1024  # rows converted to Python at a time


@dataclass
class RawRecord:
    """One record before decoding: a JSONL line's bytes (newline included), or one table row as a dict."""

    source: str  # file path
    line: int  # 1-based line (JSONL) or row (tables) number
    payload: bytes | dict


@dataclass
class OversizedLine:
    """A JSONL line longer than the limit: its size only, its bytes were skipped."""

    source: str
    line: int
    size: int  # bytes, newline included


def _not_a_regular_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a data file (checked without opening it: a FIFO would block), or None."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if path.is_symlink() else "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    return "is a FIFO, not a regular file" if stat.S_ISFIFO(mode) else "is not a regular file"


def datasets_cache_root() -> Path:
    """The local ``datasets`` cache, where ``load_dataset`` keeps what it downloaded."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "datasets"
    return Path.home() / ".cache" / "huggingface" / "datasets"


def _hub_copy(name: str) -> Path:
    """The cache folder of Hub data set ``name`` (``org/name``), or the one-line refusal."""
    root = datasets_cache_root()
    folder = root / name.replace("/", "___")
    found = sorted(info.parent for info in folder.glob("*/*/*/dataset_info.json")) if folder.is_dir() else []
    if not found:
        raise UserError(
            f"data path {name} does not exist; it looks like a Hugging Face Hub data set, and dflash-train "
            f"reads local files only (no copy under {root}): on a machine with network, save it with "
            f"datasets.load_dataset({name!r}).save_to_disk(DIR) (or load_dataset into this cache) and pass DIR"
        )
    if len(found) > 1:
        listed = ", ".join(str(f.relative_to(folder)) for f in found)
        raise UserError(f"data path {name} has {len(found)} copies in {folder} ({listed}): pass one of them as a path")
    return found[0]


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in its own order."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"data folder {folder}: unreadable state.json of a saved data set ({exc})") from None
    return [folder / n for n in names]


def _cache_split_files(folder: Path, split: str = "train") -> list[Path]:
    """A ``datasets`` cache folder's Arrow files of ``split`` (``name-split.arrow`` or sharded)."""
    try:
        splits = sorted(json.loads((folder / "dataset_info.json").read_text()).get("splits") or {})
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"data folder {folder}: unreadable dataset_info.json ({exc})") from None
    if split not in splits:
        raise UserError(
            f"data folder {folder} (a datasets cache) has no {split!r} split (it has {', '.join(splits) or 'none'}): "
            "pass the .arrow files of the split you want"
        )
    shard = re.compile(rf"-{re.escape(split)}(-\d{{5}}-of-\d{{5}})?\.arrow$")
    files = sorted(f for f in folder.glob("*.arrow") if shard.search(f.name))
    if not files:
        raise UserError(f"data folder {folder} lists a {split!r} split but holds no .arrow file of it")
    return files


def _folder_files(folder: Path) -> list[Path]:
    """The data files a folder stands for (see the module docstring)."""
    if (folder / "dataset_dict.json").is_file():
        if not (folder / "train" / "state.json").is_file():
            raise UserError(f"data folder {folder} is a saved DatasetDict without a train split: name a split's folder")
        return _saved_dataset_files(folder / "train")
    if (folder / "state.json").is_file():
        return _saved_dataset_files(folder)
    if (folder / "dataset_info.json").is_file():
        return _cache_split_files(folder)
    found = sorted(f for f in folder.rglob("*") if f.suffix in SUFFIXES and not f.is_dir())
    if not found:
        raise UserError(f"data folder {folder} contains no .jsonl, .parquet or .arrow files")
    return found


def expand_paths(paths: list[str]) -> list[Path]:
    """The data files ``paths`` name, in order (see the module docstring). A missing path, a broken
    link, a FIFO or a device is an error; so is a Hub name without a local copy."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists() and not path.is_symlink() and _HUB_NAME.match(str(p)):
            path = _hub_copy(str(p))
        found = _folder_files(path) if path.is_dir() else [path]
        for f in found:
            problem = _not_a_regular_file(f)
            if problem:
                raise UserError(f"data {'file' if f != path else 'path'} {f if f != path else p} {problem}")
        files.extend(found)
    return files


def _cr_only(f) -> bool:
    """Whether a binary file has no LF at all and a CR somewhere: old Mac OS line endings, where the
    lines end at CR. Read chunk by chunk (a normal file answers at its first chunk), then rewound."""
    cr = False
    for chunk in iter(lambda: f.read(1 << 20), b""):
        if b"\n" in chunk:
            cr = False
            break
        cr = cr or b"\r" in chunk
    f.seek(0)
    return cr


class _CrLines:
    """``readline(limit)`` over a binary file whose lines end at CR (returned with it, as a file's
    ``readline`` returns a line with its LF)."""

    def __init__(self, f):
        self.f, self.buf = f, b""

    def readline(self, limit: int) -> bytes:
        while True:
            end = self.buf.find(b"\r", 0, limit)
            if end < 0 and len(self.buf) >= limit:
                end = limit - 1
            if end >= 0:
                line, self.buf = self.buf[: end + 1], self.buf[end + 1 :]
                return line
            chunk = self.f.read(1 << 20)
            if not chunk:
                line, self.buf = self.buf, b""
                return line
            self.buf += chunk


def _jsonl_records(file: Path, max_record_bytes: int) -> Iterator[RawRecord | OversizedLine]:
    """Lines split at a newline byte only (a raw CR inside a record belongs to the record), except in
    a file with no newline byte at all, whose lines end at CR (old Mac OS); a UTF-8 byte order mark
    before the first line dropped, blank lines skipped, none held past the limit."""
    with open(file, "rb") as f:
        end = b"\r" if _cr_only(f) else b"\n"
        readline = _CrLines(f).readline if end == b"\r" else f.readline
        number = 0
        while True:
            raw = readline(max_record_bytes + 1 + (len(_BOM) if number == 0 else 0))
            if not raw:
                return
            number += 1
            if number == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            if len(raw) > max_record_bytes:
                size = len(raw)
                while not raw.endswith(end):  # skip the rest of the line, 1 MiB at a time
                    raw = readline(1 << 20)
                    if not raw:
                        break
                    size += len(raw)
                yield OversizedLine(str(file), number, size)
            elif raw.strip():
                yield RawRecord(str(file), number, raw)


def _arrow_batches(file: Path):
    """Record batches of an Arrow IPC file (file format, else stream format), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(file))
    try:
        reader = pa.ipc.open_file(source)
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        return iter(pa.ipc.open_stream(source))


def _table_records(file: Path) -> Iterator[RawRecord]:
    """One dict per row of a Parquet or Arrow file, ``_TABLE_BATCH_ROWS`` rows converted at a time."""
    import pyarrow as pa

    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            batches = pq.ParquetFile(str(file)).iter_batches(batch_size=_TABLE_BATCH_ROWS)
        else:
            batches = _arrow_batches(file)
        number = 0
        for batch in batches:
            for start in range(0, batch.num_rows, _TABLE_BATCH_ROWS):
                for row in batch.slice(start, _TABLE_BATCH_ROWS).to_pylist():
                    number += 1
                    # A null cell is an absent key: a table holding several record shapes has nulls
                    # in the columns a row does not use.
                    yield RawRecord(str(file), number, {k: v for k, v in row.items() if v is not None})
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot read data file {file}: {str(exc).splitlines()[0] if str(exc) else exc}") from None


def table_rows(file: Path) -> int:
    """Rows of a Parquet or Arrow file, from its metadata (sizes progress bars)."""
    import pyarrow as pa

    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(str(file)).metadata.num_rows
        return sum(b.num_rows for b in _arrow_batches(file))
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"cannot read data file {file}: {exc}") from None


def count_records(files: list[Path]) -> int:
    """What ``iter_raw_records`` will yield for ``files`` (sizes progress bars): table rows from their
    metadata, non-blank JSONL lines counted 1 MiB at a time (a line of any length is never held)."""
    n = 0
    for file in files:
        if file.suffix in TABLE_SUFFIXES:
            n += table_rows(file)
            continue
        with open(file, "rb") as f:
            end = b"\r" if _cr_only(f) else b"\n"
            blank = True  # the current line so far holds only whitespace
            for chunk in iter(lambda: f.read(1 << 20), b""):
                parts = chunk.split(end)
                for i, part in enumerate(parts):
                    blank = blank and not part.strip()
                    if i < len(parts) - 1:  # a newline ends this part's line
                        n += not blank
                        blank = True
            n += not blank  # a last line without a newline
    return n


def iter_raw_records(files: list[Path], max_record_bytes: int) -> Iterator[RawRecord | OversizedLine]:
    """Every record of ``files`` (from ``expand_paths``), in order, undecoded."""
    for file in files:
        try:
            if file.suffix in TABLE_SUFFIXES:
                yield from _table_records(file)
            else:
                yield from _jsonl_records(file, max_record_bytes)
        except OSError as exc:
            raise UserError(f"cannot read data file {file}: {exc.strerror or exc}") from None
