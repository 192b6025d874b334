"""The 7 + 1 topology in miniature: torchrun launches of real processes (gloo, one thread each) on the
tiny target. The same config and seed give the same per-step losses as one process, with 2 target +
1 drafter and 2 target + 2 drafter ranks; a killed target rank is reported and the run resumes
(also with a different number of target ranks) with the uninterrupted losses; a hung rank is
detected by the timeout; a launch that does not match the topology is refused with one line."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_runs import in_process, one_thread
from shared_runs import shared
from test_train import write_data
from trained import train_on_greedy

from dflash_trainer.training.checkpoint import verify_checkpoint

SMALL = [
    "drafter.num_layers=1",
    "drafter.block_size=4",
    "data.seq_len=128",
    "data.max_anchors=8",
    "train.max_steps=6",
    "train.save_every=2",
    "train.eval_every=3",
    "train.grad_accum=2",
    "train.lr=2e-3",
    "data.max_eval_rows=2",
    "drafter.noise=uniform",  # per-row noise: it must not depend on which rank trains the row
    "drafter.noise_scale=0.05",
    "loss.kl_weight=0.15",  # the teacher rows cross the wire too
    "topology.timeout_s=60",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(debug: str = "DETAIL") -> dict:
    """One thread per process; TORCH_DISTRIBUTED_DEBUG=DETAIL makes gloo check that every rank calls the
    same collective with the same shapes, so a mismatch fails here instead of hanging NCCL on a GPU.
    (DETAIL with DDP on gloo crashes the drafter ranks with SIGSEGV in torch 2.13: the DDP launch runs
    with INFO, which checks DDP's setup across ranks but not every collective.)"""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISTRIBUTED_DEBUG": debug,
    }


def cli_command(nproc: int, args: list[str]) -> list[str]:
    """``dflash-train ARGS`` as one plain process (N = 1) or under ``torchrun --nproc-per-node N``."""
    if nproc == 1:
        return [sys.executable, "-m", "dflash_trainer.cli", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "dflash_trainer.cli",
        *args,
    ]


def train_args(out: Path, data: Path, *extra: str, flags: tuple[str, ...] = ()) -> list[str]:
    """``dflash-train`` arguments of a SMALL training run on ``data`` into ``out``."""
    args = ["train", "--config", "tiny-demo", "--no-progress", *flags]
    for item in [*SMALL, f"data.train_files=[{data}]", f"output_dir={out}", *extra]:
        args += ["--set", item]
    return args


def launch(
    out: Path, data: Path, nproc: int, *extra: str, flags: tuple[str, ...] = (), debug: str = "DETAIL"
) -> subprocess.Popen:
    """``torchrun --nproc-per-node N -m dflash_trainer.cli train ...`` (or one plain process for N = 1)."""
    return subprocess.Popen(
        cli_command(nproc, train_args(out, data, *extra, flags=flags)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(debug),
        start_new_session=True,
    )


def run(
    out: Path,
    data: Path,
    nproc: int,
    *extra: str,
    flags: tuple[str, ...] = (),
    timeout: int = 300,
    debug: str = "DETAIL",
) -> subprocess.CompletedProcess:
    proc = launch(out, data, nproc, *extra, flags=flags, debug=debug)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"launch did not finish in {timeout} s:\n{stderr[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def losses(out: Path, key: str = "loss") -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the worker processes a torchrun launcher started (its children, from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != launcher_pid:
            continue
        values = dict(v.split(b"=", 1) for v in env if b"=" in v)
        if b"RANK" in values:
            found[int(values[b"RANK"])] = int(entry.name)
    return found


def single_process_run(tmp_path_factory) -> Path:
    """A folder with ``data.jsonl`` and ``run``, the one-process run of SMALL on it; made once per test
    session and only read (test_offline.py compares its offline runs with the same run)."""

    def make(folder):
        write_data(folder / "data.jsonl", n=16, chars=700)
        result = run(folder / "run", folder / "data.jsonl", 1)
        assert result.returncode == 0, result.stderr[-3000:]

    return shared(tmp_path_factory, "single-process-run", make)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return single_process_run(tmp_path_factory) / "data.jsonl"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return single_process_run(tmp_path_factory) / "run"


def assert_same_losses(a: dict, b: dict) -> None:
    """The same steps with the same losses, bit for bit: the runs compute each step in the same order
    (target ranks only move where the features are computed; two data-parallel drafter ranks, see
    ``test_two_targets_two_data_parallel_drafters_equal_one_process``, add the same two floats)."""
    assert sorted(a) == sorted(b) and a
    for step in a:
        assert b[step] == a[step], (step, a[step], b[step])


def test_two_targets_one_drafter_equal_one_process(single, data, tmp_path):
    out = tmp_path / "run"
    result = run(out, data, 3, "topology.target_ranks=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(losses(single), losses(out))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes_received"] > 0 and r["recv_bytes_per_s"] > 0 for r in records)
    assert all(0 <= r["drafter_wait_s"] and 0 < r["target_busy_fraction"] <= 1.5 for r in records)
    # the same features and weights (the losses above are equal): the same counts, the same tau
    assert (
        records[-1]["eval_tau"]
        == [json.loads(x) for x in (single / "metrics.jsonl").read_text().splitlines()][-1]["eval_tau"]
    )
    # only drafter rank 0 writes: one line per step
    assert [r["step"] for r in records] == list(range(1, 7))


def test_two_targets_two_data_parallel_drafters_equal_one_process(single, data, tmp_path):
    out = tmp_path / "run"
    result = run(out, data, 4, "topology.target_ranks=2", "topology.drafter_ranks=2", debug="INFO")
    assert result.returncode == 0, result.stderr[-3000:]
    # Bit for bit, on any machine: SMALL's grad_accum of 2 rows over 2 drafter ranks leaves one row per
    # rank. One process adds row 1's gradient (its loss / 2) to row 0's: g0 / 2 + g1 / 2; DDP divides
    # each rank's g_r (loss / 1) by the 2 ranks and all-reduces, g0 / 2 + g1 / 2 again: one addition of
    # the same two floats (commutative and correctly rounded, whichever rank adds), and a division by a
    # power of two, which is exact short of underflow. (More ranks or rows per rank would add in
    # another order: then only a bound on how rounding grows over steps would do.)
    assert_same_losses(losses(single), losses(out))
    # the same gradient, not one 1 / ranks the size (AdamW would hide the scale; clipping does not)
    assert_same_losses(losses(single, "grad_norm"), losses(out, "grad_norm"))


ON_POLICY_LOGGED = ("loss", "forward_kl", "reverse_kl", "rollout_tau", "accepted_share", "rollout_target_tokens")


def test_on_policy_with_target_ranks_equals_one_process_and_resumes(tmp_path):
    """The on-policy stage with target ranks: 2 target ranks decode their rows' prompts with the weights
    the drafter rank broadcasts before every step and send the rollouts' rows; every logged number of
    every step equals one process's bit for bit (the same rollouts, the same features, the same loss),
    and a 1 + 1 launch resumed from the step-2 checkpoint reproduces steps 3 and 4. The drafter is the
    session's shared SFT drafter (tests/trained.py), whose drafts the target accepts: a target rank
    drafting with other weights than the drafter rank's would decode other rounds."""
    trained = train_on_greedy()
    spec, data = trained["drafter"].spec, trained["root"] / "data.jsonl"
    stage = [f"drafter.num_layers={spec.num_layers}", f"drafter.block_size={spec.block_size}", "data.seq_len=256"]
    stage += ["train.stage=on_policy", f"drafter.init_from={trained['ckpt']}", "on_policy.max_new_tokens=24"]
    stage += ["train.max_steps=4", "train.eval_every=4", "train.lr=1e-4"]
    # the one-process reference in this process at one thread, as the ranks run (tests/cli_runs.py)
    one = one_thread(*train_args(tmp_path / "one", data, *stage))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run(tmp_path / "two", data, 3, *stage, "topology.target_ranks=2")
    assert two.returncode == 0, two.stderr[-3000:]
    for key in ON_POLICY_LOGGED:
        assert_same_losses(losses(tmp_path / "one", key), losses(tmp_path / "two", key))
    taus = losses(tmp_path / "one", "rollout_tau")
    assert len(taus) == 4 and all(t > 1.5 for t in taus.values()), taus  # drafts were accepted, every step
    checkpoint = tmp_path / "two" / "checkpoints" / "step-0000002"
    resumed = run(tmp_path / "resumed", data, 2, *stage, "topology.target_ranks=1", flags=("--resume", str(checkpoint)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for key in ON_POLICY_LOGGED:
        assert losses(tmp_path / "resumed", key) == {s: v for s, v in losses(tmp_path / "one", key).items() if s > 2}


def test_killed_target_rank_is_named_then_resume_reproduces_losses(single, data, tmp_path):
    out = tmp_path / "run"
    proc = launch(out, data, 3, "topology.target_ranks=2", "train.max_steps=6")
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for the first checkpoint, then kill target rank 1
        if (out / "checkpoints").is_dir() and any(p.name.startswith("step-") for p in (out / "checkpoints").iterdir()):
            break
        time.sleep(0.2)
    pids = worker_pids(proc.pid)
    assert 1 in pids, f"no target rank 1 among {pids}"
    os.kill(pids[1], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode != 0
    done = losses(out)
    if len(done) < 6:  # the kill landed before the end: the dead rank is named, by the drafter rank
        # when the death reached it first, else by torchrun's summary of the first failure
        named = "rank 1 (target rank)" in stderr or (
            "Root Cause" in stderr and "rank      : 1 (local_rank: 1)" in stderr.split("Root Cause", 1)[1]
        )
        assert named, stderr[-3000:]
    assert all(verify_checkpoint(p) is None for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    # resume with a different number of target ranks: the data position is a global row index
    result = run(out, data, 2, "topology.target_ranks=1", flags=("--resume", "auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(losses(single), losses(out))


def test_hung_target_rank_is_detected_by_the_timeout(data, tmp_path):
    out = tmp_path / "run"
    proc = launch(
        out, data, 3, "topology.target_ranks=2", "topology.timeout_s=8", "train.max_steps=200", "train.save_every=1000"
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.jsonl").is_file():
        time.sleep(0.2)
    pids = worker_pids(proc.pid)
    assert 0 in pids
    os.kill(pids[0], signal.SIGSTOP)
    # Once a rank has reported the hang, torchrun stops the others with SIGTERM and waits 30 s for the
    # stopped one, which cannot act on it: the test kills it as soon as the report is out.
    err, reported = [], threading.Event()

    def read_stderr():
        for line in proc.stderr:
            err.append(line)
            if "rank 0 (target rank)" in "".join(err) and "hung or dead" in "".join(err):
                reported.set()

    readers = [threading.Thread(target=read_stderr), threading.Thread(target=proc.stdout.read)]
    for reader in readers:
        reader.start()
    try:
        reported.wait(timeout=180)
    finally:
        try:
            os.kill(pids[0], signal.SIGKILL)  # a stopped process would wait for a SIGKILL
            proc.wait(timeout=60)  # the launcher exits on its own once every rank has
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for reader in readers:
            reader.join(timeout=60)
    stderr = "".join(err)
    assert proc.wait() != 0
    assert "rank 0 (target rank)" in stderr and "hung or dead" in stderr, stderr[-3000:]


def test_launch_that_does_not_match_the_topology_is_one_line(data, tmp_path):
    result = in_process(*train_args(tmp_path / "run", data, "topology.target_ranks=2"))  # refused before any work
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("dflash-train: error: topology.target_ranks is 2: launch")
    result = run(tmp_path / "run2", data, 2, "topology.target_ranks=2")
    assert result.returncode != 0
    assert "world size 2 does not match topology.target_ranks 2 + topology.drafter_ranks 1 = 3" in result.stderr
