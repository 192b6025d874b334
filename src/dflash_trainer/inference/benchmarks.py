"""Named benchmark sets for ``dflash-train eval --benchmark NAME=PATH``: reading their records, and the
overall figures across sets.

A benchmark's records are chats (``data.columns`` maps other column names), pre-tokenized records, or
prompts only: a chat whose last turn is the user's, or a record with no conversation but a string
column ``prompt_key`` (``question`` for gsm8k, ``problem`` for math500, ``prompt`` for humaneval; a list
of strings, as mt-bench's and SPEED-Bench's ``turns``, gives its first). A
prompts-only record gets an empty assistant turn that the target fills with its greedy continuation
(``regenerate``'s code), so that acceptance is measured on what the target itself would answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..data.records import BadRecord, Record, decode_payload, parse_record
from ..data.sources import expand_paths, iter_raw_records
from ..errors import UserError

NO_ASSISTANT = "no assistant turn"


def parse_benchmark_spec(text: str) -> tuple[str, str]:
    """``"gsm8k=data/gsm8k.jsonl"`` -> ``("gsm8k", "data/gsm8k.jsonl")``; one line for anything else."""
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise UserError(f"--benchmark takes NAME=PATH (e.g. gsm8k=data/gsm8k.jsonl), got {text!r}")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise UserError(f"--benchmark name {name!r}: use letters, digits, '-', '_' and '.' (it names files)")
    return name, path


def _with_assistant_turn(obj: dict, columns: dict[str, str]) -> dict:
    """``obj`` (a chat without an assistant turn) with an empty assistant turn appended, in its own format."""
    key = columns.get("messages", "messages")
    if key in obj:
        turn = {columns.get("role", "role"): "assistant", columns.get("content", "content"): ""}
    else:
        key, turn = columns.get("conversations", "conversations"), {"from": "gpt", "value": ""}
    return {**obj, key: [*obj[key], turn]}


def benchmark_record(obj, source: str, line: int, columns: dict[str, str], prompt_key: str) -> tuple:
    """``(Record or BadRecord, needs_generation)`` for one decoded record of a benchmark file."""
    conversation_keys = [columns.get(k, k) for k in ("messages", "conversations", "input_ids")]
    if isinstance(obj, dict) and prompt_key in obj and not any(k in obj for k in conversation_keys):
        prompt = obj[prompt_key]
        if isinstance(prompt, list) and prompt:  # mt-bench's and SPEED-Bench's "turns": the first turn
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt.strip():
            return BadRecord(source, line, f"{prompt_key!r} is not a non-empty string"), False
        turn = {columns.get("role", "role"): "user", columns.get("content", "content"): prompt}
        rest = {k: v for k, v in obj.items() if k != prompt_key}
        obj = {**rest, columns.get("messages", "messages"): [turn]}
    record = parse_record(obj, source, line, columns)
    if isinstance(record, BadRecord) and record.reason == NO_ASSISTANT:
        return parse_record(_with_assistant_turn(obj, columns), source, line, columns), True
    return record, False


def read_benchmark(path: str, columns: dict[str, str], prompt_key: str, max_record_bytes: int) -> tuple:
    """Every record of a benchmark ``path`` (file or folder, as ``data.train_files`` takes them):
    ``(records, needs_generation, bad)`` where ``needs_generation[i]`` says record i is prompts only."""
    if not Path(path).exists():
        raise UserError(f"--benchmark {path}: no such file or folder")
    records, generate, bad = [], [], []
    for raw in iter_raw_records(expand_paths([path]), max_record_bytes):
        obj = decode_payload(raw, max_record_bytes)
        if isinstance(obj, BadRecord):
            bad.append(obj)
            continue
        record, needs = benchmark_record(obj, raw.source, raw.line, columns, prompt_key)
        if isinstance(record, BadRecord):
            bad.append(record)
        else:
            records.append(record)
            generate.append(needs)
    return records, generate, bad


def record_json(record: Record) -> dict:
    """A ``Record`` as the JSONL record training reads (the input's extra keys kept)."""
    if record.input_ids is not None:
        return {**record.extra, "input_ids": record.input_ids, "loss_mask": record.loss_mask}
    return {**record.extra, "messages": record.messages}


def _weighted(pairs: Sequence[tuple[float | None, float]]) -> float | None:
    """Mean of the values weighted by their counts; None when nothing was counted."""
    total = sum(n for v, n in pairs if v is not None)
    return sum(v * n for v, n in pairs if v is not None) / total if total else None


def overall(reports: Sequence[dict]) -> dict:
    """One checkpoint's figures over all benchmarks, from its per-benchmark ``acceptance_report``s: each
    tau is the mean over every block (round) of every benchmark, so a set counts by its size."""
    blocks = [r["blocks"] for r in reports]
    out: dict = {
        "blocks": sum(blocks),
        "tau": _weighted([(r["tau"], n) for r, n in zip(reports, blocks)]),
        "decode_tau": _weighted([(r.get("decode_tau"), r.get("decode_rounds", 0)) for r in reports]),
        "budgets": reports[0]["budgets"],
        "ddtree_tau": [
            _weighted([(r["ddtree_tau"][i], n) for r, n in zip(reports, blocks)])
            for i in range(len(reports[0]["budgets"]))
        ],
    }
    sampled = [r["sampling"] for r in reports if r.get("sampling")]
    if sampled:
        chains = [s["measured"]["chain"] for s in sampled]
        out["sampling"] = {
            "temperature": sampled[0]["temperature"],
            "expected_tau": _weighted([(s["expected"]["tau"], r["blocks"]) for s, r in zip(sampled, reports)]),
            "measured_tau": _weighted([(c["tau"], c["rounds"]) for c in chains]),
            "rounds": sum(c["rounds"] for c in chains),
        }
    return out
