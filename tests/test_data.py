"""Data pipeline: loss masks from real chat templates, bad-record accounting, packing invariants."""

import copy
import json
import os
import random

import pytest
import torch

from dflash_trainer.data.chat import tokenize_conversation
from dflash_trainer.data.documents import DataReport, Document, load_documents
from dflash_trainer.data.packing import doc_ids_from_positions, pack_documents
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target import tiny_target_path

# Llama-3 (Meta-Llama-3-8B-Instruct) chat template, verbatim: it trims content and ends turns with
# <|eot_id|> and no newline.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-Instruct chat template: injects a default system prompt, ends turns with "<|im_end|>\n".
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Rewrites earlier assistant turns once a later message exists (like templates that drop old
# reasoning): not prefix-stable, so the assistant span cannot be found by rendering prefixes.
NOT_PREFIX_STABLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}[earlier answer]{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB = 8192  # the tiny target's vocabulary
CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sum a list."},
    {"role": "assistant", "content": "def total(xs):\n    return sum(xs)"},
    {"role": "user", "content": "And the mean?"},
    {"role": "assistant", "content": "def mean(xs):\n    return sum(xs) / len(xs)"},
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)


@pytest.fixture(scope="module")
def llama3_tok(tok):
    t = copy.deepcopy(tok)
    t.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    t.bos_token = "<|begin_of_text|>"
    t.chat_template = LLAMA3_TEMPLATE
    return t


@pytest.fixture(scope="module")
def qwen25_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = QWEN25_TEMPLATE
    return t


def masked_runs(ids, mask):
    """Maximal runs of consecutive loss-mask-1 token ids."""
    runs, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


# ---------------------------------------------------------------- loss masks from chat templates


def test_tiny_template_masks_exactly_the_answer_and_im_end(tok):
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "def f(x):\n    return x"}]
    ids, mask = tokenize_conversation(tok, messages)
    assert len(ids) == len(mask)
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ids) == rendered  # the ids are the whole rendered conversation, nothing added
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1  # special, not split into characters
    runs = masked_runs(ids, mask)
    assert len(runs) == 1
    assert tok.decode(runs[0]) == "def f(x):\n    return x<|im_end|>"
    assert runs[0][-1] == 2  # <|im_end|> as one special token
    # The prompt, the "<|im_start|>assistant\n" header and the newline after <|im_end|> carry no loss.
    first = mask.index(1)
    assert tok.decode(ids[:first]) == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert mask[-1] == 0 and tok.decode(ids[-1:]) == "\n"


def test_multi_turn_masks_every_assistant_turn_and_nothing_else(tok):
    ids, mask = tokenize_conversation(tok, CONVERSATION)
    runs = masked_runs(ids, mask)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs] == [a + "<|im_end|>" for a in answers]
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    for m in CONVERSATION:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert sum(mask) == sum(len(r) for r in runs)


def test_llama3_template_trims_and_masks_eot(llama3_tok):
    messages = [
        {"role": "user", "content": "Sum a list."},
        {"role": "assistant", "content": "  return sum(xs)\n"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    ids, mask = tokenize_conversation(llama3_tok, messages)
    eot = llama3_tok.convert_tokens_to_ids("<|eot_id|>")
    assert ids[0] == llama3_tok.convert_tokens_to_ids("<|begin_of_text|>")  # the template's own BOS, once
    assert ids.count(llama3_tok.convert_tokens_to_ids("<|start_header_id|>")) == 4
    runs = masked_runs(ids, mask)
    # Llama-3 trims content, so the assistant span is the trimmed content plus <|eot_id|>.
    assert [llama3_tok.decode(r) for r in runs] == ["return sum(xs)<|eot_id|>", "You're welcome.<|eot_id|>"]
    assert all(r[-1] == eot for r in runs)
    assert mask[-1] == 1  # Llama-3 ends a turn with <|eot_id|> and no separator after it


def test_qwen25_template_with_default_system_prompt_and_tool_turn(qwen25_tok):
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Calling ls."},
        {"role": "tool", "content": "a.py b.py"},
        {"role": "assistant", "content": "There are two files."},
    ]
    ids, mask = tokenize_conversation(qwen25_tok, messages)
    text = qwen25_tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert "<tool_response>\na.py b.py\n</tool_response>" in text
    runs = masked_runs(ids, mask)
    assert [qwen25_tok.decode(r) for r in runs] == ["Calling ls.<|im_end|>", "There are two files.<|im_end|>"]


def test_template_that_is_not_prefix_stable_raises(tok):
    t = copy.deepcopy(tok)
    t.chat_template = NOT_PREFIX_STABLE_TEMPLATE
    with pytest.raises(ValueError, match="not prefix-stable"):
        tokenize_conversation(t, CONVERSATION)
    # With one assistant turn, the last, the template is stable and the mask is found.
    ids, mask = tokenize_conversation(t, CONVERSATION[:3])
    assert [t.decode(r) for r in masked_runs(ids, mask)] == [CONVERSATION[2]["content"] + "<|im_end|>"]


def test_template_failure_becomes_value_error(qwen25_tok):
    # Qwen2.5's template reads messages[0], which fails on the empty prefix before a leading assistant turn.
    with pytest.raises(ValueError, match="chat template failed"):
        tokenize_conversation(qwen25_tok, [{"role": "assistant", "content": "Hello!"}])


# ---------------------------------------------------------------- documents and the bad-record report


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_messages_sharegpt_and_pretokenized_records(tmp_path, tok):
    messages = CONVERSATION[1:3]
    sharegpt = {
        "conversations": [
            {"from": "human", "value": messages[0]["content"]},
            {"from": "gpt", "value": messages[1]["content"]},
        ]
    }
    pretok = {"input_ids": [1, 50, 60, 70, 80, 90, 2], "loss_mask": [0, 0, 1, 1, 1, 1, 1], "id": "x"}
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": messages}, "", sharegpt])
    b = write_jsonl(tmp_path / "b.jsonl", [pretok])
    docs, report = load_documents([a, b], tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=0.0)
    expected_ids, expected_mask = tokenize_conversation(tok, messages)
    assert [(d.source, d.line) for d in docs] == [(a, 1), (a, 3), (b, 1)]  # blank line 2 is not a record
    assert docs[0].input_ids == docs[1].input_ids == expected_ids  # ShareGPT roles map onto the same chat
    assert docs[0].loss_mask == docs[1].loss_mask == expected_mask
    assert (docs[2].input_ids, docs[2].loss_mask) == (pretok["input_ids"], pretok["loss_mask"])
    assert (report.n_records, report.n_documents, report.n_bad) == (3, 3, 0)
    assert report.n_tokens == sum(len(d.input_ids) for d in docs)
    assert report.n_loss_tokens == sum(sum(d.loss_mask) for d in docs)


def test_every_bad_record_kind_is_counted_with_file_and_line(tmp_path, qwen25_tok):
    good = {"messages": CONVERSATION}
    lines = [
        good,  # 1
        '{"messages": [',  # 2 invalid JSON
        {"messages": []},  # 3 empty conversation
        {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]},  # 4
        {"conversations": [{"from": "human", "value": "anyone?"}]},  # 5 no assistant turn
        {"input_ids": [10, 11, 12, 13, 14], "loss_mask": [0, 0, 0, 0, 0]},  # 6 no assistant tokens
        {"input_ids": [10, 11, 12], "loss_mask": [1, 1, 1]},  # 7 too short: 3 tokens < 4
        {"input_ids": [10, 11, 12, 13, 14, 15], "loss_mask": [0, 0, 0, 0, 1, 1]},  # 8 too short: no room after loss
        {"input_ids": [10, 11, VOCAB, 13, 14], "loss_mask": [1, 1, 1, 1, 1]},  # 9 id out of range
        {"input_ids": [10, -1, 12, 13, 14], "loss_mask": [1, 1, 1, 1, 1]},  # 10 negative id
        {"messages": [{"role": "assistant", "content": "Hello!"}]},  # 11 template error (Qwen2.5, see above)
        {"input_ids": [10, 11, 12, 13, 14, 15], "loss_mask": [0, 0, 1, 0, 0, 0]},  # 12 good: 3 tokens after p=2
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", lines)
    report_path = tmp_path / "out" / "data_report.json"
    docs, report = load_documents(
        [path], qwen25_tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=0.9, report_path=report_path
    )
    assert [d.line for d in docs] == [1, 12]
    expected = {
        2: "invalid JSON",
        3: "empty conversation",
        4: "unknown role",
        5: "no assistant turn",
        6: "no assistant tokens",
        7: "too short",
        8: "too short",
        9: "token id out of range",
        10: "token id out of range",
        11: "template error",
    }
    assert [(f, n) for f, n, _ in report.bad] == [(path, n) for n in expected]
    for _, n, reason in report.bad:
        assert reason.startswith(expected[n]), (n, reason)
    assert report.counts == {
        "too short": 2,
        "token id out of range": 2,
        "invalid JSON": 1,
        "empty conversation": 1,
        "unknown role": 1,
        "no assistant turn": 1,
        "no assistant tokens": 1,
        "template error": 1,
    }
    on_disk = json.loads(report_path.read_text())
    assert on_disk["n_records"] == 12 and on_disk["n_documents"] == 2 and on_disk["n_bad"] == 10
    assert on_disk["counts"] == report.counts
    assert on_disk["bad"][0] == {"file": path, "line": 2, "reason": "invalid JSON"}
    assert not [p for p in report_path.parent.iterdir() if p.name != "data_report.json"]  # no temp file left


def test_too_many_bad_records_stops_with_one_line_naming_the_report(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, "nope", {"messages": []}])
    report_path = tmp_path / "report.json"
    with pytest.raises(UserError) as exc:
        load_documents([path], tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=0.5, report_path=report_path)
    message = str(exc.value)
    assert "\n" not in message
    assert "2 of 3 records are bad (66.7%)" in message and "max_bad_fraction 50.0%" in message
    assert str(report_path) in message
    assert json.loads(report_path.read_text())["counts"] == {"invalid JSON": 1, "empty conversation": 1}
    # Exactly at the limit is allowed.
    docs, report = load_documents([path], tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=2 / 3)
    assert len(docs) == 1 and report.n_bad == 2


def test_too_many_bad_records_without_report_path_still_writes_one(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ["nope", {"messages": CONVERSATION}])
    with pytest.raises(UserError) as exc:
        load_documents([path], tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=0.1)
    written = str(exc.value).rsplit("see the report ", 1)[1]
    try:
        assert json.loads(open(written).read())["bad"] == [{"file": path, "line": 1, "reason": "invalid JSON"}]
    finally:
        os.unlink(written)


def test_empty_data_set_is_a_user_error(tmp_path, tok):
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(UserError, match="no records in"):
        load_documents([empty], tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=1.0)
    all_bad = write_jsonl(tmp_path / "bad.jsonl", ["nope"])
    with pytest.raises(UserError, match="no usable document among 1 records"):
        load_documents(
            [all_bad], tok, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=1.0, report_path=tmp_path / "r.json"
        )
    assert (tmp_path / "r.json").is_file()


def test_tokenizer_without_chat_template_is_a_user_error(tmp_path, tok):
    t = copy.deepcopy(tok)
    t.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(UserError, match="no chat template"):
        load_documents([path], t, vocab_size=VOCAB, min_tokens=4, max_bad_fraction=0.0)


def test_report_write_is_atomic_and_replaces(tmp_path):
    report = DataReport(files=["x"], n_records=1, bad=[("x", 1, "invalid JSON")])
    path = tmp_path / "r.json"
    path.write_text("old")
    report.write(path)
    assert json.loads(path.read_text())["n_bad"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


# ---------------------------------------------------------------- packing


def doc(ids, mask=None, line=0):
    return Document(
        input_ids=list(ids), loss_mask=list(mask if mask is not None else [1] * len(ids)), source="mem", line=line
    )


def segments(row):
    """``(ids, positions, loss_mask)`` lists of each document of a row, split by doc_ids_from_positions."""
    doc_ids = doc_ids_from_positions(row.position_ids)
    out = []
    for d in doc_ids.unique(sorted=True).tolist():
        sel = doc_ids == d
        out.append((row.input_ids[sel].tolist(), row.position_ids[sel].tolist(), row.loss_mask[sel].tolist()))
    return out


def reference_first_fit(lengths, seq_len):
    """Row index of each piece length by a plain scan over the rows (the slow, obvious version)."""
    free, where = [], []
    for n in lengths:
        for r, f in enumerate(free):
            if f >= n:
                free[r] -= n
                where.append(r)
                break
        else:
            free.append(seq_len - n)
            where.append(len(free) - 1)
    return where


def test_first_fit_layout_on_a_small_example():
    # Lengths 5, 6, 3, 2, 20 with seq_len 8: 20 splits into 8, 8, 4; first fit puts 3 after 5 and 2 after 6.
    docs = [doc(range(100 + 10 * i, 100 + 10 * i + n), line=i) for i, n in enumerate([5, 6, 3, 2])]
    docs.append(doc(range(500, 520), line=4))
    rows = pack_documents(docs, seq_len=8, pad_token_id=0)
    assert len(rows) == 5
    layout = [[s[0] for s in segments(r)] for r in rows]
    assert layout[0] == [list(range(100, 105)), list(range(120, 123))]
    assert layout[1] == [list(range(110, 116)), list(range(130, 132))]
    assert layout[2] == [list(range(500, 508))]
    assert layout[3] == [list(range(508, 516))]
    assert layout[4] == [list(range(516, 520)), [0, 0, 0, 0]]  # padding is its own document
    assert rows[4].position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rows[4].loss_mask.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_one_token_documents_stay_apart():
    rows = pack_documents([doc([7]), doc([8]), doc([9, 10])], seq_len=6, pad_token_id=0)
    assert len(rows) == 1
    assert rows[0].position_ids.tolist() == [0, 0, 0, 1, 0, 1]
    assert doc_ids_from_positions(rows[0].position_ids).tolist() == [0, 1, 2, 2, 3, 3]


def test_packing_invariants_on_random_documents():
    rng = random.Random(0)
    seq_len, pad = 32, 0
    docs = []
    for i in range(300):
        n = rng.choice([1, 2, 5, 17, 31, 32, 33, 64, 70]) if i % 3 == 0 else rng.randint(1, 40)
        docs.append(doc([rng.randint(1, VOCAB - 1) for _ in range(n)], [rng.randint(0, 1) for _ in range(n)], line=i))
    rows = pack_documents(docs, seq_len=seq_len, pad_token_id=pad)

    pieces = [
        (d.input_ids[s : s + seq_len], d.loss_mask[s : s + seq_len])
        for d in docs
        for s in range(0, len(d.input_ids), seq_len)
    ]
    found, pad_tokens = [], 0
    for r in rows:
        for t in (r.input_ids, r.position_ids, r.loss_mask):
            assert t.shape == (seq_len,) and t.dtype == torch.long
        segs = segments(r)
        for ids, pos, _mask in segs:
            assert pos == list(range(len(ids)))  # every document restarts at 0 and counts up
        # Real tokens never equal pad (ids >= 1 above), so the padding is recognisable: the last segment only.
        real = [s for s in segs if any(t != pad for t in s[0])]
        padding = [s for s in segs if all(t == pad for t in s[0])]
        assert segs[: len(real)] == real and len(padding) <= 1
        for ids, _, mask in padding:
            assert set(mask) == {0}
            pad_tokens += len(ids)
        found += [(ids, mask) for ids, _, mask in real]
    # Every piece appears once, whole, as its own document; totals are preserved.
    assert sorted(found) == sorted(pieces)
    assert sum(int(r.loss_mask.sum()) for r in rows) == sum(sum(d.loss_mask) for d in docs)
    assert len(rows) * seq_len == sum(len(d.input_ids) for d in docs) + pad_tokens
    # The placement is first-fit in order, as the plain scan does it.
    where = reference_first_fit([len(p[0]) for p in pieces], seq_len)
    expected_rows = [[] for _ in range(max(where) + 1)]
    for p, r in zip(pieces, where):
        expected_rows[r].append(p)
    assert [[(ids, mask) for ids, _, mask in segments(r) if any(t != pad for t in ids)] for r in rows] == [
        [(list(i), list(m)) for i, m in er] for er in expected_rows
    ]
    # Deterministic.
    again = pack_documents(docs, seq_len=seq_len, pad_token_id=pad)
    assert all(
        torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        for a, b in zip(rows, again)
    )


def test_packing_rejects_malformed_documents():
    with pytest.raises(ValueError, match="is empty"):
        pack_documents([doc([])], seq_len=4, pad_token_id=0)
    with pytest.raises(ValueError, match="loss-mask"):
        pack_documents([doc([1, 2], [1])], seq_len=4, pad_token_id=0)
    assert pack_documents([], seq_len=4, pad_token_id=0) == []


def test_loaded_documents_pack_into_rows_with_the_same_anchors(tmp_path, tok):
    # Packing must neither create anchors across documents nor lose any: the valid anchors of the rows
    # are exactly those of each document on its own.
    from dflash_trainer.data.blocks import valid_anchor_positions

    block = 4
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION[3:5]}],
    )
    docs, _ = load_documents([path], tok, vocab_size=VOCAB, min_tokens=block, max_bad_fraction=0.0)
    assert max(len(d.input_ids) for d in docs) <= 96  # no splitting, so anchors per document are comparable
    rows = pack_documents(docs, seq_len=96, pad_token_id=tok.pad_token_id)
    assert len(rows) >= 2  # several documents share a row or spill into the next
    per_doc = sorted(
        tuple(d.input_ids[p : p + block])
        for d in docs
        for p in valid_anchor_positions(
            torch.tensor(d.loss_mask), torch.zeros(len(d.input_ids), dtype=torch.long), block
        ).tolist()
    )
    per_row = sorted(
        tuple(r.input_ids[p : p + block].tolist())
        for r in rows
        for p in valid_anchor_positions(r.loss_mask, doc_ids_from_positions(r.position_ids), block).tolist()
    )
    assert per_row == per_doc and per_doc
