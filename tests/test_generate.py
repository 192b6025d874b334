"""``dflash-train generate``: regenerated turns equal plain HF generation, batching changes nothing,
multi-turn prompts hold earlier regenerated turns, skips are reported by file:line, and an interrupted
run resumes without duplicates or a half-written OUT."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runs import in_process, one_thread

from dflash_trainer.commands.generate import add_generate_parser, run_generate
from dflash_trainer.data.records import Record, iter_records
from dflash_trainer.errors import UserError
from dflash_trainer.inference.regenerate import (
    SKIP_EMPTY,
    SKIP_PRETOKENIZED,
    GenerationStats,
    Skipped,
    regenerate_records,
)
from dflash_trainer.tiny_target import load_tiny_target
from dflash_trainer.tiny_target.corpus import load_split

NEW = 12  # max_new_tokens: enough to tell outputs apart, small enough for a 2-core CPU
EOS = (0, 2)  # <|endoftext|>, <|im_end|> (the tiny target's generation_config.json)


@pytest.fixture(scope="module")
def tiny():
    # One thread: a benchmark may share the machine, and the model is too small to gain from more.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_tiny_target()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """User prompts from held-out stdlib files; cut at different line counts so their lengths differ."""
    out = []
    for i, f in enumerate(load_split("held_out", limit=7)):
        head = "".join(f.text.splitlines(keepends=True)[: 8 - i % 4])
        out.append(f"Continue the Python module `{f.relpath}`:\n{head}")
    return out


def chat(source: str, line: int, *texts: str, **extra) -> Record:
    """Record of alternating user/assistant turns; assistant turns hold placeholder text to be replaced."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    return Record(source, line, messages=messages, extra=extra)


def plain_generate(model, tokenizer, messages: list[dict]) -> str:
    """The reference: one unpadded prompt, HF greedy generate, cut at the first eos, no special tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        row = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    end = next((i for i, t in enumerate(row) if t in EOS), len(row))
    return tokenizer.decode(row[:end], skip_special_tokens=True)


def regen(records, model, tokenizer, **kw) -> list[dict]:
    kw = {"max_new_tokens": NEW, "batch_size": 4, "progress": False, **kw}
    return list(regenerate_records(records, model, tokenizer, **kw))


def test_greedy_equals_plain_generate(tiny, prompts):
    model, tokenizer = tiny
    out = regen([chat("a.jsonl", 3, prompts[0], "placeholder", id="x1")], model, tokenizer)
    assert len(out) == 1
    expected = plain_generate(model, tokenizer, [{"role": "user", "content": prompts[0]}])
    assert expected and expected != "placeholder"
    assert out[0] == {
        "id": "x1",
        "source": "a.jsonl:3",
        "messages": [{"role": "user", "content": prompts[0]}, {"role": "assistant", "content": expected}],
    }


def test_batched_equals_unbatched(tiny, prompts):
    model, tokenizer = tiny
    records = [chat("b.jsonl", i + 1, p, "placeholder") for i, p in enumerate(prompts)]
    lengths = {len(tokenizer.apply_chat_template(r.messages[:1], tokenize=False)) for r in records}
    assert len(lengths) > 1, "prompts must differ in length, or no padding is exercised"
    stats = GenerationStats()
    batched = regen(records, model, tokenizer, batch_size=5, stats=stats)  # batches of 5 and 2
    single = regen(records, model, tokenizer, batch_size=1)
    assert stats.generate_calls == 2 and stats.turns == len(records)
    assert [r["source"] for r in batched] == [f"b.jsonl:{i + 1}" for i in range(len(records))]
    assert [r["messages"] for r in batched] == [r["messages"] for r in single]


def test_multi_turn_prompts_hold_earlier_regenerated_turns(tiny, prompts):
    model, tokenizer = tiny
    follow_up = "Now write a function that uses it."
    two_turns = chat("c.jsonl", 1, prompts[1], "old answer 1", follow_up, "old answer 2")
    two_turns.messages.insert(0, {"role": "system", "content": "You write Python."})
    one_turn = chat("c.jsonl", 2, prompts[2], "old")  # same batch, fewer rounds
    out = regen([two_turns, one_turn], model, tokenizer, batch_size=2)

    system, user1 = two_turns.messages[:2]
    first = plain_generate(model, tokenizer, [system, user1])
    second = plain_generate(
        model,
        tokenizer,
        [system, user1, {"role": "assistant", "content": first}, {"role": "user", "content": follow_up}],
    )
    assert out[0]["messages"] == [
        system,
        user1,
        {"role": "assistant", "content": first},
        {"role": "user", "content": follow_up},
        {"role": "assistant", "content": second},
    ]
    assert out[1]["messages"][1]["content"] == plain_generate(model, tokenizer, one_turn.messages[:1])
    assert two_turns.messages[2]["content"] == "old answer 1"  # the input record is not mutated


def test_sampling_is_seeded(tiny, prompts):
    model, tokenizer = tiny
    records = [chat("d.jsonl", i + 1, p, "x") for i, p in enumerate(prompts[:4])]
    torch.manual_seed(1)
    a = regen(records, model, tokenizer, temperature=1.0, top_p=0.9, seed=7)
    torch.manual_seed(2)  # the caller's global RNG state must not matter
    b = regen(records, model, tokenizer, temperature=1.0, top_p=0.9, seed=7)
    assert a == b
    # Deterministic, so these cannot flake: sampling really samples, and the seed really is used.
    assert a != regen(records, model, tokenizer)
    assert a != regen(records, model, tokenizer, temperature=1.0, top_p=0.9, seed=8)
    before = torch.get_rng_state()
    regen(records, model, tokenizer, temperature=1.0, seed=7)
    assert torch.equal(torch.get_rng_state(), before), "generation must not consume the caller's RNG"


def test_empty_generation_is_skipped(tiny, prompts):
    model, tokenizer = tiny
    messages = [{"role": "user", "content": prompts[3]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    first = int(model(ids).logits[0, -1].argmax())
    # Make the model's first greedy token an eos for this run: its generation is then empty.
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [*EOS, first]
    skipped: list[Skipped] = []
    try:
        out = regen([chat("e.jsonl", 9, prompts[3], "x")], model, tokenizer, on_skip=skipped.append)
    finally:
        model.generation_config.eos_token_id = original
    assert out == [] and skipped == [Skipped("e.jsonl:9", SKIP_EMPTY)]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def write_jsonl(path: Path, lines: list) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")


def test_cli_reports_bad_and_pretokenized_records(tmp_path, tiny, prompts):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(
        data / "a.jsonl",
        [
            {"id": 1, "messages": [{"role": "user", "content": prompts[0]}, {"role": "assistant", "content": "x"}]},
            "{not json",
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
            "",  # blank lines are not records
            {"id": 4, "conversations": [{"from": "human", "value": prompts[1]}, {"from": "gpt", "value": "y"}]},
            {"messages": [{"role": "user", "content": "no answer"}]},
        ],
    )
    out = tmp_path / "out.jsonl"
    args = make_parser().parse_args(
        [
            "generate",
            "--input",
            str(data),
            "--output",
            str(out),
            "--max-new-tokens",
            str(NEW),
            "--batch-size",
            "2",
            "--no-progress",
        ]
    )
    assert run_generate(args) == 0
    assert not Path(f"{out}.partial").exists()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    src = str(data / "a.jsonl")
    assert [(r["id"], r["source"]) for r in rows] == [(1, f"{src}:1"), (4, f"{src}:5")]
    assert rows[1]["messages"][0] == {"role": "user", "content": prompts[1]}  # ShareGPT comes out as messages
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["records_written"] == 2 and report["records_skipped"] == 3
    assert report["skipped"] == {
        "bad record: invalid JSON": {"count": 1, "records": [f"{src}:2"]},
        "bad record: no assistant turn": {"count": 1, "records": [f"{src}:6"]},
        SKIP_PRETOKENIZED: {"count": 1, "records": [f"{src}:3"]},
    }


def test_cli_reads_cr_only_line_endings(tmp_path, tiny, prompts):
    """An old-Mac JSONL (CR line endings, no LF) is regenerated record by record, counted right."""
    data = tmp_path / "mac.jsonl"
    lines = [
        json.dumps({"id": i, "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}]})
        for i, p in enumerate(prompts[:2])
    ]
    data.write_bytes("\r".join(lines).encode() + b"\r")
    out = tmp_path / "out.jsonl"
    args = make_parser().parse_args(
        ["generate", "--input", str(data), "--output", str(out), "--max-new-tokens", "2", "--no-progress"]
    )
    assert run_generate(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["source"]) for r in rows] == [(0, f"{data}:1"), (1, f"{data}:2")]


def test_cli_user_errors(tmp_path):
    parser = make_parser()
    missing = parser.parse_args(["generate", "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o")])
    with pytest.raises(UserError, match="does not exist"):
        run_generate(missing)
    (tmp_path / "in.jsonl").write_text("{}\n")
    no_folder = parser.parse_args(
        ["generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "no" / "out.jsonl")]
    )
    with pytest.raises(UserError, match="output folder .* does not exist"):
        run_generate(no_folder)


def test_resume_keeps_written_records_and_drops_a_torn_line(tmp_path, tiny, prompts):
    data = tmp_path / "in.jsonl"
    write_jsonl(
        data,
        [
            {"id": i, "messages": [{"role": "user", "content": prompts[i]}, {"role": "assistant", "content": "old"}]}
            for i in range(3)
        ],
    )
    out = tmp_path / "out.jsonl"
    partial = Path(f"{out}.partial")
    kept = {"id": 0, "messages": [{"role": "user", "content": "KEPT"}], "source": f"./{data.relative_to(tmp_path)}:1"}
    # A kill mid-write leaves a last line without its newline; a relative spelling of the path still matches.
    partial.write_text(json.dumps(kept) + "\n" + '{"id": 1, "messa', encoding="utf-8")
    args = make_parser().parse_args(
        [
            "generate",
            "--input",
            str(data),
            "--output",
            str(out),
            "--max-new-tokens",
            str(NEW),
            "--no-progress",
            "--limit",
            "2",
        ]
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert run_generate(args) == 0
    finally:
        os.chdir(cwd)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0] == kept and [r["id"] for r in rows] == [0, 1]  # --limit 2: record 2 is not touched
    assert rows[1]["source"] == f"{data}:2" and rows[1]["messages"][1]["content"] != "old"


CLI = "import sys; from dflash_trainer.cli import main; sys.exit(main(sys.argv[1:]))"


def test_resume_after_kill(tmp_path, tiny, prompts):
    """Kill the real CLI after its first batch; the rerun writes every record exactly once."""
    model, tokenizer = tiny
    n = 10
    records = [
        {
            "id": i,
            "messages": [
                {"role": "user", "content": prompts[i % len(prompts)] + "#" * i},
                {"role": "assistant", "content": "old"},
            ],
        }
        for i in range(n)
    ]
    data = tmp_path / "chats.jsonl"
    write_jsonl(data, records)
    out = tmp_path / "regen.jsonl"
    partial = Path(f"{out}.partial")
    cmd = [
        sys.executable,
        "-c",
        CLI,
        "generate",
        "--input",
        str(data),
        "--output",
        str(out),
        "--max-new-tokens",
        str(NEW),
        "--batch-size",
        "2",
        "--no-progress",
        "--set",
        "target.dtype=float32",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (partial.exists() and partial.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "no batch written within 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    first_run = partial.read_text().splitlines()
    assert 1 <= len(first_run) < n

    # the rerun and the refusal after it in this process (tests/cli_runs.py): the kill is the process boundary
    done = one_thread(*cmd[3:])
    assert done.returncode == 0, done.stderr[-2000:]
    assert not partial.exists()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(n))  # every record exactly once
    assert out.read_text().splitlines()[: len(first_run)] == first_run  # the first run's lines are kept
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["records_resumed"] == len(first_run) and report["records_generated"] == n - len(first_run)
    assert f"wrote {n} records" in done.stdout

    # Greedy float32: the resumed file equals one uninterrupted in-process run.
    expected = regen(list(iter_records([str(data)])), model, tokenizer, batch_size=3)
    assert sorted(rows, key=lambda r: r["id"]) == expected

    again = in_process(*cmd[3:])
    assert again.returncode == 2 and "already exists" in again.stderr
