"""Resume and checkpoints under hostile conditions (issue 15): no lost or doubled metrics, no NaN
checkpoint, no orphan temp folders, no silent restart over corrupt checkpoints, no silent config
change, a full disk ends in one error and a resumable run."""

import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hardening_run import mounted_tmpfs
from test_train import SMALL, write_data

from dflash_trainer.config import load_config
from dflash_trainer.data.packing import PackedRow
from dflash_trainer.errors import UserError
from dflash_trainer.io import sha256_file
from dflash_trainer.training.checkpoint import config_changes, find_resume_checkpoint, verify_checkpoint
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.trainer import Trainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny target and packed rows of one small data set, shared by every test here."""
    root = tmp_path_factory.mktemp("data")
    data = write_data(root / "data.jsonl", n=8)
    cfg = cfg_for(data, root / "run")
    target, tok, rows, eval_rows, _ = prepare(cfg)
    return data, target, tok, rows, eval_rows


def cfg_for(data, out, *extra):
    return load_config(
        ["tiny-demo"],
        [
            *SMALL,
            "train.max_steps=6",
            "train.save_every=3",
            "train.eval_every=6",
            f"data.train_files=[{data}]",
            f"output_dir={out}",
            *extra,
        ],
    )


def trainer(setup, out, *extra, rows=None, eval_rows=None):
    data, target, tok, train_rows, held_out = setup
    return Trainer(
        cfg_for(data, out, *extra),
        target,
        tok,
        train_rows if rows is None else rows,
        held_out if eval_rows is None else eval_rows,
        out_dir=out,
        target_path="tiny",
        progress=False,
    )


def metric_steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def rewrite_checksums(ckpt):
    names = [p.name for p in sorted(ckpt.iterdir()) if p.name != "checksums.json"]
    (ckpt / "checksums.json").write_text(json.dumps({n: sha256_file(ckpt / n) for n in names}))


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
    """One complete 6-step run (checkpoints at 3 and 6): the reference, and a template to damage."""
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer(setup, out).fit()
    return out


def copy_run(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


# ---------------------------------------------------------------- metrics and temp folders


def test_resume_cuts_metrics_to_the_checkpoint_and_removes_dead_writes(setup, finished, tmp_path, capsys):
    # A kill after step 6 was logged but before its checkpoint finished: step-0000006 is a dead temp folder.
    out = copy_run(finished, tmp_path)
    (out / "checkpoints" / "step-0000006").rename(out / "checkpoints" / ".step-0000006.x1y2z3")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.0')  # and a torn line
    trainer(setup, out).fit(resume="auto")
    printed = capsys.readouterr().out
    assert "removed" in printed and ".step-0000006.x1y2z3" in printed
    assert "resumed from" in printed and "at step 3" in printed
    assert metric_steps(out) == [1, 2, 3, 4, 5, 6]  # each step once
    assert losses(out) == losses(finished)  # and the same numbers
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000003", "step-0000006"]


# ---------------------------------------------------------------- corrupt checkpoints


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("list", "checksums.json is not a mapping"),
        ("empty-and-truncated", "checksums.json does not list drafter.safetensors"),
        ("nan-weights", "non-finite weights"),
        ("bit-flip", "does not match its checksum"),
    ],
)
def test_damaged_checkpoints_fail_verification(finished, tmp_path, damage, reason):
    ckpt = copy_run(finished, tmp_path) / "checkpoints" / "step-0000006"
    if damage == "list":
        (ckpt / "checksums.json").write_text("[]")
    elif damage == "empty-and-truncated":
        (ckpt / "checksums.json").write_text("{}")
        with open(ckpt / "drafter.safetensors", "r+b") as f:
            f.truncate(100)
    elif damage == "nan-weights":  # checksums that match NaN weights: the run itself wrote them
        weights = load_file(str(ckpt / "drafter.safetensors"))
        weights["norm.weight"] = torch.full_like(weights["norm.weight"], float("nan"))
        save_file(weights, str(ckpt / "drafter.safetensors"))
        rewrite_checksums(ckpt)
    else:
        with open(ckpt / "trainer_state.pt", "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 8)
    assert reason in verify_checkpoint(ckpt)
    assert find_resume_checkpoint(ckpt.parent.parent).name == "step-0000003"


def test_every_checkpoint_corrupt_refuses_unless_told_to_start_over(setup, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    for ckpt in (out / "checkpoints").iterdir():
        (ckpt / "checksums.json").write_text("[]")
    with pytest.raises(
        UserError,
        match="every checkpoint in .* is corrupt \\(step-0000006: checksums.json is not a mapping .*; "
        "step-0000003: checksums.json is not a mapping .*\\); start over with --overwrite",
    ):
        trainer(setup, out).fit(resume="auto")
    assert metric_steps(out) == [1, 2, 3, 4, 5, 6]  # nothing appended, nothing overwritten
    trainer(setup, out).fit(resume="auto", overwrite=True)
    assert metric_steps(out) == [1, 2, 3, 4, 5, 6]  # one fresh run's log
    assert verify_checkpoint(out / "checkpoints" / "step-0000006") is None


def test_resume_from_a_missing_path_says_so(setup, tmp_path):
    with pytest.raises(UserError, match="checkpoint /nonexistent/ckpt does not exist"):
        trainer(setup, tmp_path / "run").fit(resume="/nonexistent/ckpt")


def test_non_finite_weights_are_never_saved(setup, tmp_path):
    t = trainer(setup, tmp_path / "run")
    with torch.no_grad():
        t.drafter.fc.weight[0, 0] = float("inf")
    with pytest.raises(UserError, match="drafter weights are not finite \\(fc.weight\\); nothing was written"):
        t.save_checkpoint()
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_non_finite_gradient_skips_the_step(setup, tmp_path):
    t = trainer(setup, tmp_path / "run")
    before = t.drafter.fc.weight.detach().clone()
    # A finite loss whose gradient is not finite: a hook turns one gradient into inf.
    t.drafter.fc.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    assert t.train_step() is None and t.c.skipped_nonfinite == 1
    assert torch.equal(t.drafter.fc.weight, before) and torch.isfinite(t.drafter.fc.weight).all()


# ---------------------------------------------------------------- changed settings


def test_resume_refuses_settings_that_change_a_step_and_names_each(setup, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    cfg = cfg_for(
        setup[0], out, "drafter.block_size=8", "drafter.num_layers=2", "data.train_files=[]", "train.eval_every=2"
    )
    assert config_changes(out / "checkpoints" / "step-0000006", cfg) == [
        "drafter.num_layers: 1 -> 2",
        "drafter.block_size: 4 -> 8",
        f"data.train_files: [{str(setup[0])!r}] -> []",
    ]
    with pytest.raises(UserError, match="drafter.num_layers: 1 -> 2; drafter.block_size: 4 -> 8"):
        trainer(setup, out, "drafter.num_layers=2", "drafter.block_size=8").fit(resume="auto")
    # Settings that do not change a step (when to evaluate, save) may change.
    trainer(setup, out, "train.eval_every=3", "train.save_every=2").fit(resume="auto")


# ---------------------------------------------------------------- data without blocks


def test_rows_without_any_block_are_refused_before_the_first_step(setup, tmp_path):
    _, _, _, rows, eval_rows = setup
    no_loss = [PackedRow(r.input_ids, r.position_ids, torch.zeros_like(r.loss_mask)) for r in rows]
    with pytest.raises(UserError, match="no training block: none of the"):
        trainer(setup, tmp_path / "a", rows=no_loss).fit()
    no_eval = [PackedRow(r.input_ids, r.position_ids, torch.zeros_like(r.loss_mask)) for r in eval_rows]
    with pytest.raises(UserError, match="no evaluation block: none of the"):
        trainer(setup, tmp_path / "b", eval_rows=no_eval).fit()
    assert not (tmp_path / "b" / "metrics.jsonl").exists()  # no step was spent


# ---------------------------------------------------------------- a full disk


def test_full_disk_during_a_checkpoint_is_one_error_and_resumable(setup, finished, tmp_path):
    weights = sum(p.stat().st_size for p in (finished / "checkpoints" / "step-0000003").iterdir())
    run_files = sum(p.stat().st_size for p in finished.iterdir() if p.is_file())
    with mounted_tmpfs(tmp_path / "disk", f"{(run_files + weights // 2) // 1024 + 64}k") as disk:
        out = disk / "run"
        with pytest.raises(
            UserError,
            match="cannot write checkpoint .*step-0000003: .* MB free on its disk; the earlier checkpoints are intact",
        ):
            trainer(setup, out).fit()
        assert not any(p.name.startswith(".step-") for p in (out / "checkpoints").iterdir())
        subprocess.run(["mount", "-o", f"remount,size={2 * weights // 1024 + 4096}k", str(disk)], check=True)
        trainer(setup, out).fit(resume="auto")
        assert metric_steps(out) == [1, 2, 3, 4, 5, 6]
        assert losses(out) == losses(finished)


def test_documents_whose_pieces_hold_no_block_stop_with_one_error_not_a_hang(tmp_path):
    # Each document passes its own check (a loss position with 4 tokens after it), but rows of 8 tokens
    # cut it where no block of 4 fits: before, train_step looked for an anchor forever.
    data = tmp_path / "tok.jsonl"
    record = {"input_ids": list(range(10, 20)), "loss_mask": [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]}
    data.write_text((json.dumps(record) + "\n") * 4)
    cfg = cfg_for(data, tmp_path / "run", "data.seq_len=8")
    target, tok, rows, eval_rows, _ = prepare(cfg)
    t = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    with pytest.raises(UserError, match=r"no training block: none of the \d+ packed rows holds a block of 4 tokens"):
        t.fit()
