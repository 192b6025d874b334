"""``drafter.init_from`` (training/warm_start.py): training starts from a drafter folder's weights, whatever
layout the folder has, and a folder that does not fit the run is refused in one line.

"Starts where it ended": the session's shared drafter (tests/trained.py, 150 steps) is exported in both
layouts; a run warm-started from the checkpoint or either export, for one step at a learning rate of
1e-30 (below what moves an fp32 weight; the schema wants one > 0), evaluates on the same held-out row
exactly as the shared run's last evaluation did, and its first training loss is far below a randomly
initialized run's. "Learns the new data": the drafter fine-tuned from it on chats of another kind (real
module text) scores a higher held-out tau on that kind than it did before."""

import json

import pytest
from cli_runs import in_process
from trained import train_on_greedy


@pytest.fixture(scope="module")
def trained():
    return train_on_greedy()


@pytest.fixture(scope="module")
def sources(trained, tmp_path_factory):
    """The shared drafter as its checkpoint and as its two exports."""
    root = tmp_path_factory.mktemp("exports")
    out = {"checkpoint": trained["ckpt"]}
    for fmt in ("zlab", "speculators"):
        done = in_process("export", "--format", fmt, str(trained["ckpt"]), str(root / fmt))
        assert done.returncode == 0, done.stderr
        out[fmt] = root / fmt
    return out


def run_args(trained, out, *extra: str) -> list[str]:
    """The shared run's own settings (its run.yaml), one step into ``out``."""
    args = ["train", "--config", str(trained["root"] / "run" / "run.yaml"), "--no-progress"]
    for item in [
        f"output_dir={out}",
        "data.features=null",
        "train.max_steps=1",
        "train.eval_every=1",
        "train.save_every=1",
        *extra,
    ]:
        args += ["--set", item]
    return args


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_warm_start_from_each_layout_starts_where_the_drafter_ended(trained, sources, tmp_path):
    ended = [m for m in metrics(trained["root"] / "run") if "eval_tau" in m][-1]
    assert ended["eval_tau"] > 1.5  # a trained drafter: the comparison below is not of two blank ones
    fresh = in_process(*run_args(trained, tmp_path / "fresh"))
    assert fresh.returncode == 0, fresh.stderr
    fresh_loss = metrics(tmp_path / "fresh")[0]["loss"]
    for name, folder in sources.items():
        out = tmp_path / name
        done = in_process(*run_args(trained, out, "train.lr=1e-30", f"drafter.init_from={folder}"))
        assert done.returncode == 0, (name, done.stderr)
        assert f"starting from the weights of {folder}" in done.stdout
        first = metrics(out)[0]
        # the weights unchanged by a step at lr 1e-30: the same held-out row scores what it scored at the end,
        # exactly (the same drafts accepted: tau and the slot acceptances are ratios of the same counts)
        assert first["eval_tau"] == ended["eval_tau"], name
        assert first["eval_slot_acceptance"] == ended["eval_slot_acceptance"], name
        assert first["loss"] < 0.5 * fresh_loss, (name, first["loss"], fresh_loss)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["drafter.num_layers=3"], "has num_layers 2 where this run has 3: set drafter.num_layers=2"),
        (["drafter.block_size=4"], "has block_size 8 where this run has 4: set drafter.block_size=8"),
        (["drafter.variant=dspark"], "has variant 'dflash' where this run has 'dspark': set drafter.variant=dflash"),
        (["target.num_feature_layers=3"], "does not match the target"),
    ],
)
def test_a_folder_that_does_not_fit_the_run_is_refused_in_one_line(trained, sources, tmp_path, extra, message):
    done = in_process(*run_args(trained, tmp_path / "out", f"drafter.init_from={sources['checkpoint']}", *extra))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"drafter.init_from {sources['checkpoint']}" in lines[0] and message in lines[0], lines


def test_a_path_that_is_no_drafter_folder_is_refused_in_one_line(trained, tmp_path):
    for path, message in [
        (tmp_path / "missing", "is not a folder"),
        (trained["root"] / "run", "drafter.init_from"),
    ]:
        done = in_process(*run_args(trained, tmp_path / "out", f"drafter.init_from={path}"))
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines


def source_records(files) -> list[dict]:
    """Chats asking to continue a standard-library module, answered with the module's real text (up to
    2,000 characters): data of another kind than the target's own greedy answers the drafter trained on."""
    records = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        user = f"Continue the Python module `{f.relpath}`:\n{''.join(lines[:8])}"
        answer = "".join(lines[8:])[:2000]
        records.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return records


def test_a_fine_tune_on_new_data_raises_its_held_out_tau_on_that_data(trained, tmp_path):
    """The shared drafter fine-tuned (drafter.init_from) on chats answered with real module text scores a
    higher teacher-forced tau on held-out chats of that kind than it did before: the fine-tune starts from
    the drafter and learns the new data, rather than the run ignoring the folder or starting over. The
    new data's train and held-out chats are different modules of the tiny target's training split; its
    features are captured once, as a user fine-tuning on a new domain would."""
    from dflash_trainer.tiny_target.corpus import load_split

    files = [f for f in load_split("train", limit=120) if len(f.text) > 2500][:44]
    assert len(files) == 44
    new_train, new_eval = tmp_path / "new_train.jsonl", tmp_path / "new_eval.jsonl"
    for path, part in ((new_train, files[:36]), (new_eval, files[36:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in source_records(part)))
    data = [f"data.train_files=[{new_train}]", f"data.eval_files=[{new_eval}]", "data.max_eval_rows=4"]
    config = ["--config", str(trained["root"] / "run" / "run.yaml"), "--no-progress"]
    sets = [a for s in [*data, "data.features=null", "capture.dtype=float32"] for a in ("--set", s)]
    captured = in_process("capture", *config, *sets, "--out", str(tmp_path / "features"))
    assert captured.returncode == 0, captured.stderr
    features = [f"data.features={tmp_path / 'features'}"]
    init = f"drafter.init_from={trained['ckpt']}"

    before = in_process(*run_args(trained, tmp_path / "before", *data, *features, init, "train.lr=1e-30"))
    assert before.returncode == 0, before.stderr
    steps = ["train.max_steps=80", "train.eval_every=80", "train.save_every=80"]
    tuned = in_process(*run_args(trained, tmp_path / "tuned", *data, *features, init, *steps))
    assert tuned.returncode == 0, tuned.stderr
    tau_before = [m for m in metrics(tmp_path / "before") if "eval_tau" in m][-1]["eval_tau"]
    tau_after = [m for m in metrics(tmp_path / "tuned") if "eval_tau" in m][-1]["eval_tau"]
    print(f"held-out tau on the new data: {tau_before:.3f} before, {tau_after:.3f} after 80 fine-tuning steps")
    assert tau_after > tau_before + 0.1, (tau_before, tau_after)
