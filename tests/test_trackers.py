"""``train.trackers`` (training/trackers.py): a run logs to TensorBoard, wandb, MLflow and trackio at once,
each in its local mode (TensorBoard's event files, wandb offline, an MLflow's SQLite store, trackio's local
SQLite store), and every value read back with the tracker's own reader equals ``metrics.jsonl``; a resumed
run continues the same tracker runs; a tracker whose package is missing is refused in one line.

The runs are real ``dflash-train train`` processes (trackio reads its store's location when imported, and
wandb starts its service process), trained from the session's shared drafter's feature cache."""

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
from trained import train_on_greedy

from dflash_trainer.training.trackers import scalars

PROJECT = "tracker-test"


@pytest.fixture(scope="module")
def trained():
    return train_on_greedy()


def expected(out) -> dict[int, dict[str, float]]:
    """metrics.jsonl, flattened the way the trackers get it: step -> {name: value}."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: scalars(r) for r in records}


def read_tensorboard(out) -> tuple[dict[int, dict[str, float]], str]:
    """The scalars (step -> {tag: value}) and the config text of ``out/tensorboard``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()  # applies purge_step: the steps a resumed run logged again are kept once
    got: dict[int, dict[str, float]] = {}
    text = ""
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            value = make_ndarray(event.tensor_proto).item()  # one float64, or the text's bytes
            if tag == "config/text_summary":
                text = value.decode()
            else:
                got.setdefault(event.step, {})[tag] = value
    return got, text


def wandb_records(path):
    """The protobuf records of a wandb ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then
    LevelDB's log format (32 KiB blocks of records: crc32, uint16 length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def read_wandb(out) -> tuple[set[str], dict[int, dict[str, float]], list[dict]]:
    """Run ids, history (last value per step) and configs of every offline run under ``out/wandb``."""
    ids, got, configs = set(), {}, []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                configs.append({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                step = int(items.pop("_step"))
                got.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return ids, got, configs


def read_mlflow(out) -> tuple[list, dict[int, dict[str, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(PROJECT)
    runs = client.search_runs([experiment.experiment_id])
    got: dict[int, dict[str, float]] = {}
    for run in runs:
        for key in run.data.metrics:
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
                got.setdefault(m.step, {})[key] = m.value  # the last logged value of a step wins
    return runs, got


def read_trackio(env) -> dict:
    """trackio's store, read by trackio in a process that sees the test's TRACKIO_DIR."""
    script = textwrap.dedent(
        f"""
        import json
        from trackio.sqlite_storage import SQLiteStorage
        logs = SQLiteStorage.get_logs({PROJECT!r}, "tracked")
        print(json.dumps({{"runs": SQLiteStorage.get_runs({PROJECT!r}),
                          "config": SQLiteStorage.get_run_config({PROJECT!r}, "tracked"), "logs": logs}}, default=str))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], name: str) -> None:
    assert sorted(got) == sorted(want), (name, sorted(got), sorted(want))
    for step, values in want.items():
        assert set(values) <= set(got[step]), (name, step, set(values) - set(got[step]))
        for key, value in values.items():  # float64 all the way: equal, not close
            assert got[step][key] == value, (name, step, key, got[step][key], value)


def test_a_run_logs_to_all_four_trackers_and_a_resumed_run_continues_them(trained, tmp_path):
    out = tmp_path / "run"
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    trackers = "train.trackers=[tensorboard,wandb,mlflow,trackio]"
    # Stopped with SIGTERM (as a preempted job is) after a few steps: it saves a checkpoint where it is,
    # closes its trackers and exits; the resumed run continues from that step to the end.
    cli = _cli(trained, out, trackers, "train.max_steps=40")
    first = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    said, err = first.communicate(timeout=300)
    stopped_at = len(metrics.read_text().splitlines())
    assert "SIGTERM: saved" in said and 3 <= stopped_at < 40, (stopped_at, err[-3000:])
    resumed = subprocess.run([*cli, "--resume", "auto"], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:07d}'}" in resumed.stdout
    want = expected(out)
    assert sorted(want) == list(range(1, 41)) and "eval_slot_acceptance/0" in want[40]

    got, text = read_tensorboard(out)
    same(got, want, "tensorboard")
    assert "run `tracked`" in text and f"tracker_project: {PROJECT}" in text

    ids, got, configs = read_wandb(out)
    assert len(ids) == 1, ids  # the resumed run continued the same wandb run
    same(got, want, "wandb")
    assert configs[0]["train"]["tracker_project"] == PROJECT

    runs, got = read_mlflow(out)
    assert len(runs) == 1 and runs[0].info.run_name == "tracked" and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["train.tracker_project"] == PROJECT and runs[0].data.params["name"] == "tracked"
    same(got, want, "mlflow")

    store = read_trackio(env)
    assert store["runs"] == ["tracked"], store["runs"]
    assert store["config"]["train"]["tracker_project"] == PROJECT
    got = {}
    for entry in store["logs"]:
        got.setdefault(entry["step"], {}).update({k: v for k, v in entry.items() if k not in ("step", "timestamp")})
    same(got, want, "trackio")


def _cli(trained, out, *extra):
    root = trained["root"]
    sets = [
        f"output_dir={out}",
        f"data.features={root / 'features'}",
        "train.eval_every=10",
        "train.save_every=100",
        f"train.tracker_project={PROJECT}",
        "name=tracked",
        *extra,
    ]
    args = [sys.executable, "-m", "dflash_trainer.cli", "train", "--config", str(root / "run" / "run.yaml")]
    return args + ["--no-progress", *[a for s in sets for a in ("--set", s)]]


def test_a_tracker_that_is_not_installed_is_refused_in_one_line(trained, tmp_path):
    """A process in which ``wandb`` cannot be imported: ``sys.modules["wandb"] = None`` is Python's own
    way to make an import fail (``import wandb`` raises ImportError, ``find_spec`` finds nothing)."""
    hide = "import sys\nsys.modules['wandb'] = None\n"
    cli = _cli(trained, tmp_path / "run", "train.trackers=[tensorboard,wandb]")
    code = hide + "from dflash_trainer.cli import main\nsys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, *cli[3:]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'dflash-trainer[wandb]'" in lines[0], lines
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_records_flatten_to_the_scalars_the_trackers_get():
    record = {"step": 7, "loss": 1.5, "ok": True, "eval_slot_acceptance": [0.5, 0.25], "feed": {"wait_s": 2}, "s": "x"}
    assert scalars(record) == {
        "loss": 1.5,
        "ok": 1.0,
        "eval_slot_acceptance/0": 0.5,
        "eval_slot_acceptance/1": 0.25,
        "feed/wait_s": 2.0,
    }
