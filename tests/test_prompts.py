"""inference/prompts.py: the prompts speculate and export --serve decode, from chat records."""

import json

from transformers import AutoTokenizer

from dflash_trainer.data.records import BadRecord, Record, iter_records
from dflash_trainer.inference.prompts import chat_prompts
from dflash_trainer.tiny_target import tiny_target_path

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "11"},
]


def test_a_prompt_is_the_turns_before_the_first_assistant_turn_with_the_generation_prompt(tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)
    lines = [
        {"messages": TURNS},
        {"messages": [{"role": "user", "content": "no answer yet"}]},  # no assistant turn: skipped
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},  # pre-tokenized: skipped
        {"messages": TURNS[1:3]},
    ]
    f = tmp_path / "chats.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    records = list(iter_records([str(f)]))
    assert any(isinstance(r, BadRecord) for r in records) and all(isinstance(r, Record | BadRecord) for r in records)
    want = tok.apply_chat_template(TURNS[:2], tokenize=False, add_generation_prompt=True)
    got = chat_prompts(records, tok)
    assert [where for where, _ in got] == [f"{f}:1", f"{f}:4"]
    assert tok.decode(got[0][1]) == want
    assert tok.decode(got[1][1]) == tok.apply_chat_template(TURNS[1:2], tokenize=False, add_generation_prompt=True)
    assert chat_prompts(records, tok, limit=1) == got[:1]
    dicts = [{"id": "a", "messages": TURNS}, {"messages": TURNS[1:3]}, "not a record"]
    assert [w for w, _ in chat_prompts(dicts, tok)] == ["a", "record 1"]
    assert chat_prompts(dicts, tok)[0][1] == got[0][1]
