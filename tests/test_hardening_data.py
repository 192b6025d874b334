"""Hostile data and config inputs (issue 15): each ends in a counted skip with file:line, one error
line (exit 2), or the correct result; never a traceback, never a hang."""

import json
import os
import subprocess
import sys

import pytest

from dflash_trainer.config import load_config
from dflash_trainer.config.loader import ConfigError, strict_yaml_load
from dflash_trainer.data.documents import load_documents
from dflash_trainer.data.records import expand_paths, iter_records
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target import tiny_target_path

GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, friend."}]}
GOOD_LINE = json.dumps(GOOD).encode() + b"\n"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)


def read(path, **kw):
    return [(type(r).__name__, r.line, getattr(r, "reason", None)) for r in iter_records([str(path)], **kw)]


def cli(*args, timeout=120):
    """The real command line in a subprocess: (returncode, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr


# ---------------------------------------------------------------- records: never a traceback


@pytest.mark.parametrize(
    "line, reason",
    [
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON: nested too deep"),
        (b'{"input_ids": [' + b"7" * 5000 + b"]}", "invalid JSON: Exceeds the limit"),
        (b'{"messages": [{"role": "assistant", "content": "a\\ud800b"}]}', "invalid JSON: a lone surrogate"),
        (b'{"id": "\\udfff", ' + GOOD_LINE[1:-2] + b"}", "invalid JSON: a lone surrogate"),
        (b'{"messages": [{"role": "assistant", "content": "caf\xe9"}]}', "invalid UTF-8: byte"),
        (b'{"messages": "hello"}', "messages is not a list of turns"),
    ],
    ids=["deep-nesting", "5000-digit-int", "surrogate-content", "surrogate-extra-key", "invalid-utf8", "str-messages"],
)
def test_hostile_lines_are_counted_bad_records(tmp_path, line, reason):
    path = tmp_path / "x.jsonl"
    path.write_bytes(GOOD_LINE + line + b"\n" + GOOD_LINE)
    got = read(path)
    assert [g[:2] for g in got] == [("Record", 1), ("BadRecord", 2), ("Record", 3)]
    assert got[1][2].startswith(reason), got[1][2]


def test_lines_end_at_newline_only_and_a_bom_is_ignored(tmp_path):
    # A raw CR between JSON tokens, and U+2028 / U+0085 inside a string, are part of the record, not
    # line breaks (str.splitlines and text-mode files split at all three).
    inner = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "y\u2028z\x85w"}]}
    raw = json.dumps(inner, ensure_ascii=False).replace(", ", ",\r ").encode()
    assert b"\r" in raw
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE + raw + b"\n" + b"not json\n")
    records = list(iter_records([str(path)]))
    assert [(type(r).__name__, r.line) for r in records] == [("Record", 1), ("Record", 2), ("BadRecord", 3)]
    assert records[1].messages[1]["content"] == "y\u2028z\x85w"


def test_a_file_with_cr_only_line_endings_is_read_line_by_line(tmp_path):
    """Old-Mac files end lines with CR alone: with no LF anywhere that reading is the only one, so each
    CR-separated line is a record, numbered as such (a file that has an LF keeps CR inside records)."""
    path = tmp_path / "mac.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE.rstrip(b"\n") + b"\r\rnot json\r" + GOOD_LINE.rstrip(b"\n"))
    got = read(path)
    assert [g[:2] for g in got] == [("Record", 1), ("BadRecord", 3), ("Record", 4)]
    assert list(iter_records([str(path)]))[2].messages == GOOD["messages"]
    crlf = tmp_path / "dos.jsonl"
    crlf.write_bytes(GOOD_LINE.replace(b"\n", b"\r\n") * 2)
    assert [g[:2] for g in read(crlf)] == [("Record", 1), ("Record", 2)]


def test_oversized_record_is_skipped_and_counted(tmp_path, tok):
    path = tmp_path / "x.jsonl"
    huge = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y" * 5000}]}
    path.write_bytes(GOOD_LINE * 3 + json.dumps(huge).encode() + b"\n")
    assert read(path, max_record_bytes=1000)[3][2].startswith("record too large: 5,")
    docs, report = load_documents(
        [str(path)], tok, vocab_size=len(tok), min_tokens=2, max_bad_fraction=0.5, max_record_bytes=1000
    )
    assert len(docs) == 3 and report.counts == {"record too large": 1}
    assert report.bad[0][:2] == (str(path), 4)
    cfg = load_config(["tiny-demo"], ["data.max_record_bytes=1000"])
    assert cfg.data.max_record_bytes == 1000


def test_whitespace_only_assistant_turn_is_a_bad_record(tmp_path, tok):
    blank = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n\t"}]}
    path = tmp_path / "x.jsonl"
    path.write_bytes(GOOD_LINE + json.dumps(blank).encode() + b"\n")
    docs, report = load_documents([str(path)], tok, vocab_size=len(tok), min_tokens=2, max_bad_fraction=0.9)
    assert len(docs) == 1 and report.bad == [(str(path), 2, "empty assistant turn")]


# ---------------------------------------------------------------- data paths: no hang, no traceback


def test_a_directory_named_jsonl_inside_a_folder_is_a_folder(tmp_path):
    (tmp_path / "d" / "x.jsonl").mkdir(parents=True)
    (tmp_path / "d" / "x.jsonl" / "y.jsonl").write_bytes(GOOD_LINE)
    (tmp_path / "d" / "z.jsonl").write_bytes(GOOD_LINE)
    assert [p.name for p in expand_paths([str(tmp_path / "d")])] == ["y.jsonl", "z.jsonl"]


@pytest.mark.parametrize("kind", ["broken-link", "fifo", "broken-link-in-folder", "fifo-in-folder"])
def test_special_files_are_refused_without_blocking(tmp_path, kind):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(GOOD_LINE)
    bad = folder / "x.jsonl"
    if kind.startswith("fifo"):
        os.mkfifo(bad)
    else:
        bad.symlink_to(tmp_path / "gone.jsonl")
    named = str(folder) if kind.endswith("folder") else str(bad)
    expected = "FIFO" if kind.startswith("fifo") else "broken symbolic link"
    with pytest.raises(UserError, match=expected):
        list(iter_records([named]))


def test_fifo_data_file_through_the_cli_exits_2_with_one_line(tmp_path):
    fifo = tmp_path / "x.jsonl"
    os.mkfifo(fifo)
    code, _, err = cli(
        "train", "--config", "tiny-demo", "--set", f"data.train_files=[{fifo}]", "--set", f"output_dir={tmp_path}/run"
    )
    assert code == 2 and err.strip().splitlines() == [
        f"dflash-train: error: data path {fifo} is a FIFO, not a regular file"
    ]


# ---------------------------------------------------------------- config: YAML and values


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert bomb.stat().st_size < 1000
    with pytest.raises(ConfigError, match=r"bomb.yaml at line \d+, column \d+: YAML aliases expand to more than"):
        load_config([str(bomb)])


def test_yaml_anchors_and_merge_keys_used_the_ordinary_way_are_read(tmp_path):
    """Anchors, aliases and merge keys (``<<: *d``) whose expansion stays small mean what YAML says."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "defaults: &d {lr: 3.0e-4, seed: 7}\n"
        "layers: &ids [1, 2, 3, 4, 5]\n"
        "train:\n  <<: *d\n  steps: 5\n  seed: 9\n"
        "target:\n  layer_ids: *ids\n"
    )
    data = strict_yaml_load(path.read_text())
    assert data["train"] == {"lr": 3.0e-4, "seed": 9, "steps": 5} and data["target"]["layer_ids"] == [1, 2, 3, 4, 5]
    path.write_text("train: &t {lr: 3.0e-4, seed: 7}\ndrafter: {num_layers: 2}\n")
    assert load_config([str(path)]).train.lr == 3.0e-4
    # the schema still names what it does not know (an alias does not smuggle keys past it)
    path.write_text("defaults: &d {lr: 3.0e-4}\ntrain:\n  <<: *d\n")
    with pytest.raises(ConfigError, match="unknown config key 'defaults'"):
        load_config([str(path)])


def test_a_recursive_yaml_alias_is_one_error_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(ConfigError, match=r"r.yaml at line 1, column \d+: .*recursive"):
        load_config([str(path)])


def test_duplicate_yaml_keys_are_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n  seed: 1\n  lr: 2e-3\n")
    with pytest.raises(ConfigError, match=r"c.yaml at line 4, column 3: duplicate key 'lr'"):
        load_config([str(path)])


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "nan", "inf"])
def test_non_finite_floats_are_refused(value):
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(["tiny-demo"], [f"train.lr={value}"])
    with pytest.raises(ConfigError, match="loss.gamma"):
        load_config(["tiny-demo"], [f"loss.gamma={value}"])
