"""Read training records from local JSONL files or folders, in the shapes the field uses.

Accepted record shapes (one JSON object per line):
- ``{"messages": [{"role": "user"|"assistant"|"system"|"tool", "content": str}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
- pre-tokenized: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (same length)

Every record comes back as a ``Record`` (normalized) or a ``BadRecord`` that names the file, the line
and the reason, so callers can skip and count instead of crashing or silently dropping.
"""

from __future__ import annotations

import json
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


def expand_paths(paths: list[str]) -> list[Path]:
    """Files named directly, plus every ``*.jsonl`` under named folders (sorted); a missing path is an error."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = sorted(path.rglob("*.jsonl"))
            if not found:
                raise UserError(f"data folder {p} contains no .jsonl files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"data path {p} does not exist")
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
        turns, key_role, key_text, mapping = obj["messages"], "role", "content", None
    elif "conversations" in obj:
        turns, key_role, key_text, mapping = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        return BadRecord(source, line, "no messages, conversations or input_ids")
    if not isinstance(turns, list) or not turns:
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


def iter_records(paths: list[str]) -> Iterator[Record | BadRecord]:
    """Every line of every file, in order, as a ``Record`` or a ``BadRecord`` (blank lines skipped)."""
    for file in expand_paths(paths):
        with open(file, encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError:
                    yield BadRecord(str(file), number, "invalid JSON")
                    continue
                yield parse_record(obj, str(file), number)
