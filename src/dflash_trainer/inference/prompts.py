"""Prompts from chat records, as ``speculate`` and ``export --serve`` decode them: a record's turns
before its first assistant turn, through the tokenizer's chat template with the generation prompt."""

from __future__ import annotations

from collections.abc import Iterable

from ..data.records import Record


def chat_prompts(records: Iterable, tokenizer, limit: int | None = None) -> list[tuple[str, list[int]]]:
    """``[(where, prompt token ids)]`` of the first ``limit`` records (all when None) that have an
    assistant turn. ``records`` are ``data.records.Record`` (``BadRecord`` and pre-tokenized records
    are skipped; where = "file:line") or dicts with "messages" (where = their "id")."""
    prompts = []
    for i, rec in enumerate(records):
        if isinstance(rec, Record):
            messages, where = rec.messages, f"{rec.source}:{rec.line}"
        elif isinstance(rec, dict):
            messages, where = rec.get("messages"), str(rec.get("id", f"record {i}"))
        else:
            continue
        first_assistant = next((j for j, m in enumerate(messages or []) if m["role"] == "assistant"), None)
        if first_assistant is None:
            continue
        ids = tokenizer.apply_chat_template(messages[:first_assistant], tokenize=True, add_generation_prompt=True)
        prompts.append((where, list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
        if limit and len(prompts) >= limit:
            break
    return prompts
