"""The work loops the commands call (issue 36), where the CLI tests do not already pin them: the
writer contract of ``regenerate_into`` (``generate``: one write per batch, skipped records counted)
and ``speculate_bench``'s refusal of an unknown mode. Both without a model: an engine stand-in
answers the generation calls, as ``serving.engines`` would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from dflash_trainer.data.records import BadRecord, Record
from dflash_trainer.inference.regenerate import SKIP_PRETOKENIZED, regenerate_into
from dflash_trainer.inference.speculate_bench import speculate_bench
from dflash_trainer.tiny_target import tiny_target_path


class EchoEngine:
    """``serving.engines``' interface: a completion per prompt, ``(text, new tokens, cut)``."""

    def __init__(self):
        self.calls: list[int] = []

    def complete(self, prompts, max_tokens, temperature, top_p, seed):
        self.calls.append(len(prompts))
        return [(f"reply to {len(ids)} tokens", 3, False) for ids in prompts]


def chat(line: int, **extra) -> Record:
    messages = [{"role": "user", "content": f"question {line}"}, {"role": "assistant", "content": "old"}]
    return Record("a.jsonl", line, messages=messages, extra=extra)


def test_regenerate_into_writes_once_per_batch_and_counts_skips():
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)
    # the weightless stand-in a generation engine needs here: context length and eos ids
    model = SimpleNamespace(
        config=SimpleNamespace(max_position_embeddings=4096),
        generation_config=SimpleNamespace(eos_token_id=[0, 2], top_k=None),
    )
    records = [chat(1, id="x"), BadRecord("a.jsonl", 2, "invalid JSON"), chat(3), Record("a.jsonl", 4, input_ids=[5])]
    writes: list[list[dict]] = []
    engine = EchoEngine()
    run = regenerate_into(
        records, model, tokenizer, writes.append, max_new_tokens=4, batch_size=2, progress=False, engine=engine
    )
    # batch 1: the two chat records (and the bad one between them); batch 2: only the pre-tokenized
    # record, skipped, still written (as nothing) so a flushing writer syncs once per batch
    assert [[r["source"] for r in batch] for batch in writes] == [["a.jsonl:1", "a.jsonl:3"], []]
    assert writes[0][0]["id"] == "x" and writes[0][0]["messages"][1]["content"].startswith("reply to ")
    assert engine.calls == [2]
    assert run.generated == 2
    assert run.skipped == {"bad record: invalid JSON": ["a.jsonl:2"], SKIP_PRETOKENIZED: ["a.jsonl:4"]}
    assert (run.stats.turns, run.stats.new_tokens, run.stats.generate_calls) == (2, 6, 1)
    assert run.seconds >= 0


def test_speculate_bench_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be 'chain' or 'ddtree', got 'tree'"):
        speculate_bench(None, None, None, [], [], mode="tree")
