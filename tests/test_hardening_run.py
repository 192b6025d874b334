"""Hostile run conditions (issue 15): bad output folders, a truncated target, a read-only or full disk
in ``generate``. Each ends in one error line (or a resumable state), never a traceback."""

import argparse
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trainer.commands import generate as generate_cmd
from dflash_trainer.commands.generate import add_generate_parser, run_generate
from dflash_trainer.config import load_config, write_resolved_config
from dflash_trainer.errors import UserError
from dflash_trainer.tiny_target import tiny_target_path

PROMPT = {"messages": [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "x"}]}


def cli(*args, timeout=300):
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout, proc.stderr


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-train: error: "), err
    return lines[0]


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str, readonly: bool = False):
    """A real small (or read-only) file system at ``path``; the test is skipped where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        if readonly:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def readonly_folder(tmp_path: Path):
    """A folder no one can write to: a read-only mount as root, mode 0555 otherwise."""
    if os.geteuid() == 0:
        return mounted_tmpfs(tmp_path / "ro", "64k", readonly=True)
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return contextlib.nullcontext(folder)


# ---------------------------------------------------------------- output_dir


@pytest.mark.parametrize("kind", ["a-file", "parent-a-file"])
def test_output_dir_that_cannot_be_a_folder_is_one_error(tmp_path, kind):
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" if kind == "a-file" else tmp_path / "f" / "run"
    with pytest.raises(UserError, match=f"output_dir {out}"):
        write_resolved_config(load_config(["tiny-demo"]), out)


def test_read_only_output_dir_is_one_error(tmp_path):
    with readonly_folder(tmp_path) as ro:
        with pytest.raises(UserError, match=f"output_dir {ro / 'run'}"):
            write_resolved_config(load_config(["tiny-demo"]), ro / "run")


def test_output_dir_a_file_through_the_cli(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d.jsonl").write_text(json.dumps(PROMPT) + "\n")
    code, _, err = cli(
        "train",
        "--config",
        "tiny-demo",
        "--set",
        f"output_dir={tmp_path / 'f'}",
        "--set",
        f"data.train_files=[{tmp_path / 'd.jsonl'}]",
    )
    assert code == 2 and "is a file, not a folder" in one_error_line(err)


# ---------------------------------------------------------------- target


def test_truncated_target_weights_are_one_error_line(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny_target_path(), target)
    with open(target / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    # Trainable data: the data are prepared before the weights are read, and must not fail first.
    (tmp_path / "d.jsonl").write_text(2 * (json.dumps({"input_ids": list(range(3, 60))}) + "\n"))
    code, _, err = cli(
        "train",
        "--config",
        "tiny-demo",
        "--set",
        f"target.path={target}",
        "--set",
        f"data.train_files=[{tmp_path / 'd.jsonl'}]",
        "--set",
        f"output_dir={tmp_path / 'run'}",
    )
    assert code == 2 and f"cannot load target from {target}" in one_error_line(err)


# ---------------------------------------------------------------- generate


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def gen_args(inp, out, *extra):
    return make_parser().parse_args(
        ["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "4", "--no-progress", *extra]
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_generate_temperature_must_be_finite(tmp_path, value, capsys):
    with pytest.raises(SystemExit) as exc:
        gen_args(tmp_path / "i.jsonl", tmp_path / "o.jsonl", "--temperature", value)
    assert exc.value.code == 2 and "must be a finite number >= 0" in capsys.readouterr().err


def test_generate_refuses_a_folder_named_out_partial(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(PROMPT) + "\n")
    (tmp_path / "out.jsonl.partial").mkdir()
    with pytest.raises(UserError, match="out.jsonl.partial exists and is not a file"):
        run_generate(gen_args(inp, tmp_path / "out.jsonl"))


def test_generate_output_equal_to_an_input_names_that(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(PROMPT) + "\n")
    with pytest.raises(UserError, match="is also an input file"):
        run_generate(gen_args(inp, inp))


def test_generate_into_a_read_only_folder_is_one_error(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(PROMPT) + "\n")
    with readonly_folder(tmp_path) as ro:
        with pytest.raises(UserError, match="is not writable"):
            run_generate(gen_args(inp, ro / "out.jsonl"))


def test_generate_disk_full_at_the_report_keeps_the_records_and_reruns(tmp_path, monkeypatch):
    # The report is the last write; a full disk there (simulated: ENOSPC from the write) must leave
    # OUT.partial with every record, and the rerun must finish without generating again.
    inp = tmp_path / "in.jsonl"
    bad_key = json.dumps({"id": "\\udc80", **PROMPT}).replace("\\\\udc80", "\\udc80")
    inp.write_text(json.dumps(PROMPT) + "\n" + bad_key + "\n" + json.dumps({**PROMPT, "id": 3}) + "\n")
    out = tmp_path / "out.jsonl"

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(generate_cmd, "atomic_write_json", full)
    with pytest.raises(UserError, match="No space left on device; the records written so far are kept"):
        run_generate(gen_args(inp, out))
    assert not out.exists() and len(Path(f"{out}.partial").read_text().splitlines()) == 2
    monkeypatch.undo()
    assert run_generate(gen_args(inp, out)) == 0
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["records_resumed"] == 2 and report["records_generated"] == 0
    assert report["skipped"]["bad record: invalid JSON: a lone surrogate escape in a string"]["records"] == [f"{inp}:2"]
