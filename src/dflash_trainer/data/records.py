"""Read training records from local JSONL files or folders, in the shapes the field uses.

Accepted record shapes (one JSON object per line):
- ``{"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": str}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
- pre-tokenized: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (same length)

Every record comes back as a ``Record`` (normalized) or a ``BadRecord`` that names the file, the line
and the reason, so callers can skip and count instead of crashing or silently dropping.

Lines end at a newline byte only (a raw CR inside a record belongs to the record) and a UTF-8 byte
order mark before the first line is ignored. A line that is not valid UTF-8, holds a lone surrogate
escape, nests too deep, holds an integer too long to parse or is longer than ``max_record_bytes`` is a
``BadRecord``: never replacement characters in training text, never a traceback. Data paths that are
not regular files (a FIFO, a device, a broken link) are refused before anything is opened.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
ROLES = {"system", "user", "assistant", "tool"}
DEFAULT_MAX_RECORD_BYTES = 16 << 20  # data.max_record_bytes' default: a longer line is skipped and counted
_BOM = b"\xef\xbb\xbf"
# A lone surrogate can enter a decoded string only through a \u escape (strict UTF-8 rejects its bytes).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


@dataclass
class Record:
    source: str  # file path
    line: int  # 1-based line number
    messages: list[dict] | None = None  # [{"role", "content"}], roles in ROLES
    input_ids: list[int] | None = None  # pre-tokenized records
    loss_mask: list[int] | None = None
    extra: dict = field(default_factory=dict)  # other keys of the record, kept for round trips (e.g. "id")


@dataclass
class BadRecord:
    source: str
    line: int
    reason: str  # short, stable category, e.g. "invalid JSON", "unknown role 'robot'"


@dataclass
class BadLine:
    reason: str  # why a line is not a JSON value


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


def expand_paths(paths: list[str]) -> list[Path]:
    """Files named directly, plus every ``*.jsonl`` file under named folders (sorted; a directory named
    ``x.jsonl`` is a folder, not a file). A missing path, a broken link, a FIFO or a device is an error."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = sorted(f for f in path.rglob("*.jsonl") if not f.is_dir())
            if not found:
                raise UserError(f"data folder {p} contains no .jsonl files")
            for f in found:
                problem = _not_a_regular_file(f)
                if problem:
                    raise UserError(f"data file {f} {problem}")
            files.extend(found)
        else:
            problem = _not_a_regular_file(path)
            if problem:
                raise UserError(f"data path {p} {problem}")
            files.append(path)
    return files


def parse_record(obj, source: str, line: int) -> Record | BadRecord:
    """Normalize one decoded JSON value."""
    if not isinstance(obj, dict):
        return BadRecord(source, line, "not a JSON object")
    if "input_ids" in obj:
        ids, mask = obj.get("input_ids"), obj.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return BadRecord(source, line, "input_ids is not a list of integers")
        if mask is None:
            mask = [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            return BadRecord(source, line, "loss_mask is not a 0/1 list as long as input_ids")
        extra = {k: v for k, v in obj.items() if k not in ("input_ids", "loss_mask")}
        return Record(source, line, input_ids=ids, loss_mask=[int(m) for m in mask], extra=extra)
    if "messages" in obj:
        key, key_role, key_text, mapping = "messages", "role", "content", None
    elif "conversations" in obj:
        key, key_role, key_text, mapping = "conversations", "from", "value", SHAREGPT_ROLES
    else:
        return BadRecord(source, line, "no messages, conversations or input_ids")
    turns = obj[key]
    if not isinstance(turns, list):
        return BadRecord(source, line, f"{key} is not a list of turns")
    if not turns:
        return BadRecord(source, line, "empty conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(key_text), str):
            return BadRecord(source, line, f"a turn without text ({key_text!r})")
        raw_role = turn.get(key_role)
        role = mapping.get(str(raw_role).lower()) if mapping else raw_role
        if role not in ROLES:
            return BadRecord(source, line, f"unknown role {raw_role!r}")
        messages.append({"role": role, "content": turn[key_text]})
    if not any(m["role"] == "assistant" for m in messages):
        return BadRecord(source, line, "no assistant turn")
    extra = {k: v for k, v in obj.items() if k not in ("messages", "conversations")}
    return Record(source, line, messages=messages, extra=extra)


def _decode_line(raw: bytes, max_record_bytes: int):
    """The JSON value of one line (bytes, without the BOM), or ``BadLine`` with the reason it is bad."""
    if len(raw) > max_record_bytes:
        return BadLine(f"record too large: {len(raw):,} bytes > data.max_record_bytes {max_record_bytes:,}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadLine(f"invalid UTF-8: byte {exc.start} of the line")
    try:
        obj = json.loads(text)
    except RecursionError:
        return BadLine("invalid JSON: nested too deep")
    except json.JSONDecodeError:
        return BadLine("invalid JSON")
    except ValueError as exc:  # int() refuses integers of more than sys.get_int_max_str_digits() digits
        return BadLine(f"invalid JSON: {str(exc).split(';')[0]}")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return BadLine("invalid JSON: a lone surrogate escape in a string")
        except RecursionError:
            return BadLine("invalid JSON: nested too deep")
    return obj


def iter_records(paths: list[str], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Record | BadRecord]:
    """Every line of every file, in order, as a ``Record`` or a ``BadRecord`` (blank lines skipped).
    Lines end at a newline byte only and are numbered from 1; see the module docstring for bad lines."""
    for file in expand_paths(paths):
        try:
            f = open(file, "rb")
        except OSError as exc:
            raise UserError(f"cannot read data file {file}: {exc.strerror or exc}") from None
        with f:
            # Binary iteration splits at b"\n" only: a raw CR inside a record stays in the record.
            for number, raw in enumerate(f, 1):
                if number == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM) :]
                if not raw.strip():
                    continue
                obj = _decode_line(raw, max_record_bytes)
                if isinstance(obj, BadLine):
                    yield BadRecord(str(file), number, obj.reason)
                    continue
                yield parse_record(obj, str(file), number)
