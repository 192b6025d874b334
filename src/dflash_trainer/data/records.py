"""Decode and normalize training records, in the shapes the field uses (``sources`` reads the files).

Accepted record shapes (a JSON object per JSONL line, or a table row with these columns):
- ``{"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": str}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
- pre-tokenized: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (same length)

Other column names are mapped onto these by ``columns`` (``data.columns``: ``{"messages": "chat",
"content": "text"}``; keys among ``COLUMN_KEYS``). Every record comes back as a ``Record`` (normalized)
or a ``BadRecord`` that names the file, the line and the reason, so callers can skip and count instead
of crashing or silently dropping.

A line that is not valid UTF-8, holds a lone surrogate escape, nests too deep, holds an integer too
long to parse or is longer than ``max_record_bytes`` is a ``BadRecord``: never replacement characters
in training text, never a traceback.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..config.schema import DATA_COLUMN_KEYS as COLUMN_KEYS  # noqa: F401 (named in the docstring)
from .sources import OversizedLine, RawRecord, expand_paths, iter_raw_records

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


def _renamed(obj: dict, columns: dict[str, str]) -> dict:
    """``obj`` with the user's record-level column names (``columns``' values) under ours (its keys)."""
    out = dict(obj)
    for ours, theirs in columns.items():
        if ours not in ("role", "content") and theirs in obj:
            out.pop(theirs)
            out[ours] = obj[theirs]
    return out


def parse_record(obj, source: str, line: int, columns: dict[str, str] | None = None) -> Record | BadRecord:
    """Normalize one decoded JSON value or table row; ``columns`` maps our names to the data's."""
    if not isinstance(obj, dict):
        return BadRecord(source, line, "not a JSON object")
    columns = columns or {}
    if columns:
        obj = _renamed(obj, columns)
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
        key, key_role, key_text, mapping = (
            "messages",
            columns.get("role", "role"),
            columns.get("content", "content"),
            None,
        )
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


def decode_payload(raw: RawRecord | OversizedLine, max_record_bytes: int):
    """The decoded JSON value (or table row) of a record from ``sources``, or the ``BadRecord`` that says
    why it has none (too large, not UTF-8, not JSON)."""
    if isinstance(raw, OversizedLine):
        return BadRecord(
            raw.source, raw.line, f"record too large: {raw.size:,} bytes > data.max_record_bytes {max_record_bytes:,}"
        )
    obj = raw.payload
    if isinstance(obj, bytes):
        obj = _decode_line(obj, max_record_bytes)
        if isinstance(obj, BadLine):
            return BadRecord(raw.source, raw.line, obj.reason)
    return obj


def decode_record(
    raw: RawRecord | OversizedLine, max_record_bytes: int, columns: dict[str, str] | None = None
) -> Record | BadRecord:
    """A record from ``sources`` as a ``Record``, or the ``BadRecord`` that says why it is not one."""
    obj = decode_payload(raw, max_record_bytes)
    return obj if isinstance(obj, BadRecord) else parse_record(obj, raw.source, raw.line, columns)


def iter_records(
    paths: list[str], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, columns: dict[str, str] | None = None
) -> Iterator[Record | BadRecord]:
    """Every record of every data path, in order, as a ``Record`` or a ``BadRecord`` (``sources`` says
    which files a path names and how they are read; blank JSONL lines are not records)."""
    for raw in iter_raw_records(expand_paths(paths), max_record_bytes):
        yield decode_record(raw, max_record_bytes, columns)
