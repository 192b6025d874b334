"""Offline training: ``dflash-train capture`` writes the target's features once, ``train --set
data.features=DIR`` trains from them with no target body. On the tiny target, one thread each, as the
distributed tests: an offline run equals the online run of the same config bit for bit (fp32 and bf16
storage), resumes, and runs data-parallel under torchrun; a capture is the same with one or two ranks
and continues after a SIGKILL; FP8 halves bf16; a cache that does not match the run, or is truncated,
corrupt or unfinished, is refused with one line; the body's tensors are never read.

The one-process captures and runs call ``cli.main`` in the test's process (``in_process``: what the
console script calls), at one thread as the processes run: a process start and the import of torch and
transformers (about 3 s of CPU each) bought nothing where no process boundary is checked. torchrun
launches, the killed capture, and the online run every offline run is compared with
(``single_process_run``) stay real processes."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_runs import one_thread
from safetensors.torch import load_file, save_file
from test_distributed import SMALL as DIST_SMALL
from test_distributed import _env, assert_same_losses, cli_command, losses, run, single_process_run, train_args

from dflash_trainer.config import TargetConfig
from dflash_trainer.features.codec import decode, encode
from dflash_trainer.model.loading import load_target_head, resolve_target_path

ONE_ROW_PER_SHARD = "capture.shard_bytes=1"


def capture_args(out: Path, data: Path, *extra: str) -> list[str]:
    args = ["capture", "--config", "tiny-demo", "--no-progress", "--out", str(out)]
    for item in [*DIST_SMALL, f"data.train_files=[{data}]", ONE_ROW_PER_SHARD, *extra]:
        args += ["--set", item]
    return args


def capture_cmd(out: Path, data: Path, nproc: int, *extra: str) -> list[str]:
    return cli_command(nproc, capture_args(out, data, *extra))


def capture(out: Path, data: Path, nproc: int = 1, *extra: str) -> subprocess.CompletedProcess:
    if nproc == 1:
        return one_thread(*capture_args(out, data, *extra))
    return subprocess.run(
        capture_cmd(out, data, nproc, *extra), capture_output=True, text=True, env=_env(), timeout=300
    )


def train(out: Path, data: Path, *extra: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """test_distributed.py's one-process ``run`` of SMALL, in this process."""
    return one_thread(*train_args(out, data, *extra, flags=flags))


def refused(capsys, out: Path, data: Path, *extra: str, command: str = "train") -> str:
    """The one error line of an in-process ``dflash-train train`` (refusals come before any step, so
    they are checked without a process start), asserting exit status 2."""
    from dflash_trainer.cli import main

    args = [command, "--config", "tiny-demo", "--no-progress"]
    for item in [*DIST_SMALL, f"data.train_files=[{data}]", f"output_dir={out}", *extra]:
        args += ["--set", item]
    capsys.readouterr()
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def shard_digests(folder: Path) -> dict[str, str]:
    return {name: s["sha256"] for name, s in json.loads((folder / "manifest.json").read_text())["shards"].items()}


def eval_taus(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_tau"] for r in rows if "eval_tau" in r]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return single_process_run(tmp_path_factory) / "data.jsonl"


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """The one-process online run of DIST_SMALL on ``data``: test_distributed.py's, made once a session."""
    return single_process_run(tmp_path_factory) / "run"


@pytest.fixture(scope="module")
def cache(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "features"
    result = capture(out, data)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train from it with --set data.features=" in result.stdout
    return out


@pytest.fixture(scope="module")
def offline(cache, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("offline-run") / "run"
    result = train(out, data, f"data.features={cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_codec_round_trip_is_exact_for_float_storage_and_bounded_for_fp8():
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randn(64, 96, generator=gen, dtype=torch.float64)
        * torch.logspace(-4, 3, 64, dtype=torch.float64)[:, None]
    )
    x[5] = 0  # an all-zero row keeps scale 1
    x32 = x.float()
    assert torch.equal(decode(encode(x32, "float32"), torch.float32), x32)
    xb = x.to(torch.bfloat16)
    assert torch.equal(decode(encode(xb, "bfloat16"), torch.bfloat16), xb)
    parts = encode(x32, "float8_e4m3")
    assert parts[""].dtype == torch.float8_e4m3fn and parts["scale"].shape == (64,)
    got = decode(parts, torch.float64)
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal step 2^-9 of the scaled unit
    bound = torch.maximum(x.abs() * 2**-4, parts["scale"].double()[:, None] * 2**-10) * (1 + 1e-6)
    assert ((got - x).abs() <= bound).all()
    assert torch.equal(got[5], torch.zeros(96, dtype=torch.float64))


def test_offline_run_equals_the_online_run_bit_for_bit(online, offline):
    a, b = losses(online), losses(offline)
    assert a and a == b  # exactly: the same row order, anchors, noise and features
    assert eval_taus(online) == eval_taus(offline)
    wa = load_file(str(online / "checkpoints" / "step-0000006" / "drafter.safetensors"))
    wb = load_file(str(offline / "checkpoints" / "step-0000006" / "drafter.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    record = json.loads((offline / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["cache_read_bytes_per_s"] > 0


def test_offline_run_resumes_with_the_uninterrupted_losses(offline, cache, data, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(offline, out)
    for step in ("step-0000004", "step-0000006"):  # as if killed after step 2's checkpoint
        shutil.rmtree(out / "checkpoints" / step)
    result = train(out, data, f"data.features={cache}", flags=("--resume", "auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "step 2" in result.stdout
    assert losses(out) == losses(offline)


def test_two_data_parallel_drafters_from_the_cache_equal_one_process(online, cache, data, tmp_path):
    out = tmp_path / "run"
    result = run(out, data, 2, f"data.features={cache}", "topology.drafter_ranks=2", debug="INFO")
    assert result.returncode == 0, result.stderr[-3000:]
    # one row per rank: the same two gradients added once, bit for bit (test_distributed.py's DDP check)
    assert_same_losses(losses(online), losses(out))


def test_capture_on_two_ranks_writes_the_same_shards(cache, data, tmp_path):
    out = tmp_path / "features"
    result = capture(out, data, 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert shard_digests(out) == shard_digests(cache)


def test_killed_capture_continues_where_it_stopped(cache, data, tmp_path, capsys):
    out = tmp_path / "features"
    proc = subprocess.Popen(
        capture_cmd(out, data, 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while len(list((out / "shards").glob("*.json"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    written = len(list((out / "shards").glob("*.json")))
    total = len(shard_digests(cache))
    assert 3 <= written < total, (written, total)  # killed in the middle
    assert not (out / "manifest.json").exists()
    line = refused(capsys, tmp_path / "run", data, f"data.features={out}")
    assert "is not finished" in line and "run the same" in line
    again = capture(out, data)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already written, continuing" in again.stdout
    assert shard_digests(out) == shard_digests(cache)  # nothing lost, nothing written twice
    assert not list((out / "shards").glob(".*"))  # no temporary file left


def test_bf16_target_with_bf16_storage_is_bit_identical(data, tmp_path):
    bf16 = ["target.dtype=bfloat16", "train.max_steps=3", "train.eval_every=3"]
    online = tmp_path / "online"
    assert train(online, data, *bf16).returncode == 0
    cache = tmp_path / "features"
    result = capture(cache, data, 1, *bf16)  # capture.dtype null = the target's: bfloat16
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((cache / "manifest.json").read_text())["settings"]["storage_dtype"] == "bfloat16"
    offline = tmp_path / "offline"
    result = train(offline, data, *bf16, f"data.features={cache}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(online) == losses(offline) and eval_taus(online) == eval_taus(offline)


def test_fp8_cache_is_half_of_bf16_and_trains_within_a_bound(online, cache, data, tmp_path):
    sizes = {}
    for dtype in ("bfloat16", "float8_e4m3"):
        out = tmp_path / dtype
        result = capture(out, data, 1, f"capture.dtype={dtype}")
        assert result.returncode == 0, result.stderr[-3000:]
        m = json.loads((out / "manifest.json").read_text())
        rows = m["splits"]["train"] + m["splits"]["eval"]
        assert m["bytes"] >= sum(m["row_bytes"][s] * m["splits"][s] for s in ("train", "eval"))  # + headers
        sizes[dtype] = sum(m["row_bytes"][s] * m["splits"][s] for s in ("train", "eval")) / rows
    # per token: ids/positions/mask (9 bytes) + features at 2 bytes vs 1 byte + a 4-byte scale per tensor
    assert 0.49 < sizes["float8_e4m3"] / sizes["bfloat16"] < 0.51
    out = tmp_path / "run"
    result = train(out, data, f"data.features={tmp_path / 'float8_e4m3'}")
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = losses(online), losses(out)
    assert a.keys() == b.keys() and a != b  # FP8 rounds the features: close, not equal
    assert all(abs(b[s] - a[s]) <= 0.05 * abs(a[s]) for s in a), (a, b)


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["target.layer_ids=[1,2,3,4,6]"], "other layer ids: captured [1, 2, 3, 4, 5], this run hooks [1, 2, 3, 4, 6]"),
        (["data.seq_len=256"], "other data: data.seq_len: prepared with 128, this run has 256"),
        (["drafter.block_size=8"], "other data: the shortest usable document"),
        (["target.dtype=bfloat16"], "other target: captured from"),
    ],
)
def test_a_cache_of_another_run_is_refused_with_one_line(cache, data, tmp_path, capsys, extra, message):
    line = refused(capsys, tmp_path / "run", data, f"data.features={cache}", *extra)
    assert "does not match this run" in line and message in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_cache_without_the_teacher_is_refused_when_the_loss_needs_it(data, tmp_path, capsys):
    cache = tmp_path / "features"
    result = capture(cache, data, 1, "capture.teacher=false")
    assert result.returncode == 0, result.stderr[-3000:]
    line = refused(capsys, tmp_path / "run", data, f"data.features={cache}")  # loss.kl_weight=0.15
    assert "the loss needs the teacher" in line
    ok = train(tmp_path / "run", data, f"data.features={cache}", "loss.kl_weight=0", "train.max_steps=2")
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_another_target_folder_is_refused(cache, data, tmp_path, capsys):
    other = tmp_path / "target"
    shutil.copytree(resolve_target_path("tiny"), other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta") or 10000.0) * 2
    (other / "config.json").write_text(json.dumps(config))
    line = refused(capsys, tmp_path / "run", data, f"data.features={cache}", f"target.path={other}")
    assert "other target" in line and "config.json" in line


def test_truncated_corrupt_and_unfinished_caches_are_refused(cache, data, tmp_path, capsys):
    from dflash_trainer.cli import main

    copy = _copy(cache, tmp_path)
    shard = sorted((copy / "shards").glob("train-*.safetensors"))[1]
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])
    line = refused(capsys, tmp_path / "run", data, f"data.features={copy}")
    assert f"feature shard {shard} is truncated" in line
    flipped = bytearray(good)
    flipped[-7] ^= 0xFF
    shard.write_bytes(bytes(flipped))  # same size, new modification time: its sha256 is checked
    line = refused(capsys, tmp_path / "run", data, f"data.features={copy}")
    assert f"feature shard {shard} is corrupt" in line
    assert main(["capture", "--verify", str(copy), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "1 bad shard(s)" in err and shard.name in err
    assert main(["capture", "--verify", str(cache), "--no-progress"]) == 0
    assert ": ok," in capsys.readouterr().out
    (copy / "manifest.json").unlink()
    assert "is not finished" in refused(capsys, tmp_path / "run", data, f"data.features={copy}")


def test_training_from_the_cache_never_reads_the_target_body(offline, cache, data, tmp_path):
    """A target folder holding only the embedding (the tiny target's head is tied): the offline run is
    the same, so nothing else of the target was needed, and the loader names what it read."""
    stripped = tmp_path / "target"
    shutil.copytree(resolve_target_path("tiny"), stripped)
    weights = load_file(str(stripped / "model.safetensors"))
    assert any(".layers." in k for k in weights)
    save_file({"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}, str(stripped / "model.safetensors"))
    target, _, read = load_target_head(TargetConfig(path=str(stripped), dtype="float32"))
    assert read == ["model.embed_tokens.weight"] and len(target.layers) == 0 and target.num_layers == 8
    out = tmp_path / "run"
    result = train(out, data, f"data.features={cache}", f"target.path={stripped}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(out) == losses(offline)


def test_the_planner_prices_the_cache_and_the_offline_drafter(cache, data):
    from dflash_trainer.config import load_config
    from dflash_trainer.planner.report import plan_for_config, render_json

    cfg = load_config(["tiny-demo"], [*DIST_SMALL, f"data.train_files=[{data}]", f"data.features={cache}"])
    plan = render_json(plan_for_config(cfg))
    m = json.loads((cache / "manifest.json").read_text())
    c = plan["capture"]
    assert c["rows"] == m["splits"]["train"] + m["splits"]["eval"]
    assert c["bytes_per_row"]["float32"] == m["row_bytes"]["train"]  # the tiny target runs in float32
    assert c["corpus_bytes"] <= m["bytes"] <= 1.05 * c["corpus_bytes"]  # eval rows keep the teacher too; headers
    [drafter] = plan["devices"]
    names = {i["name"] for i in drafter["items"]}
    assert "features read from the cache" in names and "target weights" not in names
    assert "target embedding + lm_head (frozen)" in names
    # without data.features: the row count of the data train prepared into the data cache
    cfg = load_config(["tiny-demo"], [*DIST_SMALL, f"data.train_files=[{data}]"])
    priced = render_json(plan_for_config(cfg))["capture"]
    assert priced["rows"] == c["rows"] and priced["rows_source"].startswith("prepared data ")
