"""A feature cache read as a bounded window while it is captured (``data.feature_window``,
``features/window.py``): ``capture`` and ``train`` run at the same time on one folder, with the same
config; at most N training shards are on disk; training waits for shards, capture for room.

Checked with real processes on the tiny target: a window run equals the run from the complete cache of
the same rows (read in the window's order) bit for bit, and still does when the training is stopped
(SIGTERM) and resumed and the capture is killed (SIGKILL) and restarted mid-way; the disk never holds
more than N training shards; the capture stops when the training has finished; a window that cannot
work is refused before training, in one line.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cli_runs import in_process
from test_distributed import losses
from test_offline import one_thread
from test_train import write_data

WINDOW = 4
SETTINGS = [
    "data.seq_len=128",
    "data.max_eval_rows=2",
    "target.dtype=float32",
    "loss.kl_weight=0.15",
    "drafter.num_layers=1",
    "drafter.block_size=4",
    "data.max_anchors=8",
    "train.max_steps=20",
    "train.eval_every=10",
    "train.save_every=2",
    "train.grad_accum=1",
    "train.lr=2e-3",
    "capture.shard_bytes=200000",  # one row per shard: 26 training shards
    f"data.feature_window={WINDOW}",
    "data.feature_window_timeout_s=300",
]


def args(command: str, data: Path, *extra: str) -> list[str]:
    out = [command, "--config", "tiny-demo", "--no-progress"]
    for item in [*SETTINGS, f"data.train_files=[{data}]", *extra]:
        out += ["--set", item]
    return out


def start(*cli_args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_trainer.cli", *cli_args],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # the runs compared bit for bit sum in the same order
    )


class ShardCount(threading.Thread):
    """The largest number of training shard files seen in ``folder`` while it runs."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.most, self.stop = folder / "shards", 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                n = sum(1 for p in self.folder.iterdir() if p.name.startswith("train-") and p.suffix == ".safetensors")
            except FileNotFoundError:
                n = 0
            self.most = max(self.most, n)
            time.sleep(0.02)


def steps_logged(run: Path) -> int:
    try:
        return sum('"loss"' in line for line in (run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_window_run_equals_the_complete_cache_run_through_a_stop_and_a_kill(tmp_path):
    data = tmp_path / "data.jsonl"
    write_data(data, n=16, chars=700)
    full, cache = tmp_path / "full", tmp_path / "window"
    # the reference: the complete cache (captured with no window), read in the window's order
    done = in_process(*args("capture", data, "data.feature_window=null"), "--out", str(full))
    assert done.returncode == 0, done.stderr[-2000:]
    ref = one_thread(
        *args(
            "train",
            data,
            f"data.features={full}",
            "data.feature_window_keep=true",
            "output_dir=" + str(tmp_path / "ref"),
        )
    )
    assert ref.returncode == 0, ref.stderr[-2000:]

    watch = ShardCount(cache)
    watch.start()
    run = tmp_path / "run"
    train_args = args("train", data, f"data.features={cache}", f"output_dir={run}")
    capture_args = [*args("capture", data), "--out", str(cache)]
    train = start(*train_args, log=tmp_path / "train1.log")
    capture = start(*capture_args, log=tmp_path / "capture1.log")
    deadline = time.time() + 240
    while steps_logged(run) < 7 and time.time() < deadline and train.poll() is None:
        time.sleep(0.05)
    train.send_signal(signal.SIGTERM)  # stops after its step, with a checkpoint
    assert train.wait(120) != 0
    capture.kill()  # mid-shard or waiting for room: it restarts where it was
    capture.wait(60)
    stopped_at = steps_logged(run)
    assert 7 <= stopped_at < 20, (tmp_path / "train1.log").read_text()[-2000:]
    released = json.loads((cache / "window.json").read_text())["released"]
    assert released > 0

    train = start(*train_args, "--resume", "auto", log=tmp_path / "train2.log")
    capture = start(*capture_args, log=tmp_path / "capture2.log")
    assert train.wait(300) == 0, (tmp_path / "train2.log").read_text()[-3000:]
    assert capture.wait(120) == 0, (tmp_path / "capture2.log").read_text()[-3000:]
    watch.stop.set()
    watch.join()

    assert losses(run) == losses(tmp_path / "ref")  # bit for bit, every step, across the stop and the kill
    assert 0 < watch.most <= WINDOW, watch.most
    capture_log = (tmp_path / "capture2.log").read_text()
    assert "capture: training finished" in capture_log and "no manifest" in capture_log
    assert json.loads((cache / "window.json").read_text())["finished"] is True
    left = sorted(p.name for p in (cache / "shards").glob("train-*.safetensors"))
    assert len(left) <= WINDOW  # the released shards' files are gone, their records kept


def test_the_window_order_reads_shards_in_order_and_shuffles_within_them():
    from dflash_trainer.training.trainer import epoch_order, shard_window_order

    for n, per in ((26, 4), (7, 1), (10, 32)):
        for epoch in (0, 1):
            order = shard_window_order(3, epoch, n, per)
            assert sorted(order.tolist()) == list(range(n))  # every row once
            assert all(int(order[g]) // per == g // per for g in range(n))  # position g is in shard g // per
    assert shard_window_order(3, 0, 26, 4).tolist() != shard_window_order(3, 1, 26, 4).tolist()
    assert shard_window_order(3, 0, 26, 4).tolist() != list(range(26))  # shuffled within shards
    assert shard_window_order(3, 0, 10, 32).tolist() == epoch_order(3, 0, 10).tolist()  # one shard: the shuffle


def test_a_window_that_cannot_work_is_refused_in_one_line(tmp_path):
    data = tmp_path / "data.jsonl"
    write_data(data, n=16, chars=700)
    cache = tmp_path / "cache"
    done = in_process(*args("capture", data, "data.feature_window=null"), "--out", str(cache))
    assert done.returncode == 0, done.stderr[-2000:]
    for extra, message in (
        (
            ["data.feature_window=2", "train.save_every=4"],
            "data.feature_window 2 holds 1 rows besides the shard being read, and the window moves at checkpoints, "
            "every train.save_every x grad_accum = 4 rows: raise data.feature_window to at least 5 or lower "
            "train.save_every",
        ),
        (
            ["train.max_steps=40"],
            "train.max_steps x grad_accum = 40 rows is more than one pass over the cache's 26 training rows, and "
            "data.feature_window deletes each shard once trained: set data.feature_window_keep=true, or fewer steps",
        ),
    ):
        run = in_process(*args("train", data, f"data.features={cache}", f"output_dir={tmp_path / 'run'}", *extra))
        assert run.returncode == 2 and run.stderr.strip().splitlines() == [f"dflash-train: error: {message}"], (
            run.stderr
        )
