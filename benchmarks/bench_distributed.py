"""Tokens/s of one process vs 2 target + 1 drafter vs 3 + 1 on this CPU, beside the planner's model.

Each configuration trains the tiny target's drafter for the same steps on the same data (one intra-op
thread per process, gloo), launched exactly as a user would (`torchrun ... -m dflash_trainer.cli
train`). Measured from metrics.jsonl: tokens/s over the steps after the first (warm-up), the
drafter's wait for data as a share of the wall time, and bytes/s received. The planner's throughput
model (``planner/throughput.py``) is evaluated for the same shapes with this CPU's measured one-thread
matmul rate as the peak; what is compared is the predicted and measured *ratio* to one process.

    python benchmarks/bench_distributed.py            # writes benchmarks/results/distributed.{json,md}
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))

SETTINGS = [
    "drafter.num_layers=2",
    "drafter.block_size=8",
    "data.seq_len=512",
    "data.max_anchors=32",
    "train.max_steps=12",
    "train.save_every=1000",
    "train.eval_every=1000",
    "train.grad_accum=1",
    "data.max_eval_rows=1",
    "loss.kl_weight=0.15",
]
LAYOUTS = [
    ("1 process", 1, []),
    ("2 target + 1 drafter", 3, ["topology.target_ranks=2"]),
    ("3 target + 1 drafter", 4, ["topology.target_ranks=3"]),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, data: Path, nproc: int, extra: list[str]) -> float:
    args = ["train", "--config", "tiny-demo", "--no-progress"]
    for item in [*SETTINGS, f"data.train_files=[{data}]", f"output_dir={out}", *extra]:
        args += ["--set", item]
    if nproc == 1:
        cmd = [sys.executable, "-m", "dflash_trainer.cli", *args]
    else:
        cmd = [
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{nproc} processes failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def gemm_rate() -> float:
    """One thread's fp32 matmul FLOP/s at a drafter-like shape (256 x 256 @ 256 x 768)."""
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 256), torch.randn(256, 768)
    for _ in range(3):
        a @ b
    t0, n = time.perf_counter(), 30
    for _ in range(n):
        a @ b
    return 2 * 2048 * 256 * 768 * n / (time.perf_counter() - t0)


def predictions(rate: float) -> dict[str, dict]:
    from dflash_trainer.config import load_config
    from dflash_trainer.planner.plan import _target_layer_ids
    from dflash_trainer.planner.report import target_shape_for, workload_from_config
    from dflash_trainer.planner.throughput import throughput

    cfg = load_config(["tiny-demo"], SETTINGS)
    shape = target_shape_for(cfg)
    w = workload_from_config(cfg)
    ids = _target_layer_ids(shape, w, cfg.target.layer_ids)
    out = {}
    cores = os.cpu_count() or 1
    for name, nproc, _extra in LAYOUTS:
        t = 0 if nproc == 1 else nproc - 1
        # processes beyond the core count share cores: each gets cores/nproc of one core's rate
        share = min(1.0, cores / nproc)
        out[name] = throughput(
            shape, w, ids, t, 1, peak_flops=rate * share, link_bytes_per_s=1e12, utilization=1.0
        ).as_dict()
    return out


def main() -> None:
    from test_train import write_data

    tmp = Path(tempfile.mkdtemp(prefix="bench-dist-"))
    data = write_data(tmp / "data.jsonl", n=60, chars=2500)
    rows = []
    for name, nproc, extra in LAYOUTS:
        out = tmp / name.replace(" ", "-")
        wall = launch(out, data, nproc, extra)
        m = read_metrics(out)
        tokens = sum(r["tokens"] for r in m[1:])
        # the wall time of steps 2..N is not in metrics.jsonl; the drafter's wait and bytes are cumulative
        row = {"layout": name, "processes": nproc, "steps": len(m), "wall_s": wall, "tokens_after_warmup": tokens}
        if nproc > 1:
            row.update(
                drafter_wait_s=m[-1]["drafter_wait_s"],
                recv_bytes_per_s=m[-1]["recv_bytes_per_s"],
                target_busy_fraction=m[-1]["target_busy_fraction"],
            )
        rows.append(row)
        print(row, flush=True)
    rate = gemm_rate()
    pred = predictions(rate)
    # Measured throughput from the end-to-end wall time minus start-up (model loading, data): the
    # start-up of each layout is measured as the wall of a 1-step run.
    startup = {}
    for name, nproc, extra in LAYOUTS:
        out = tmp / ("startup-" + name.replace(" ", "-"))
        startup[name] = launch(out, data, nproc, [*extra, "train.max_steps=1"])
    for row in rows:
        steady = row["wall_s"] - startup[row["layout"]]
        row["tokens_per_s"] = row["tokens_after_warmup"] / max(steady, 1e-9)
        row["drafter_wait_fraction"] = (
            row.get("drafter_wait_s", 0.0) / max(steady, 1e-9) if row["processes"] > 1 else None
        )
        row["predicted_tokens_per_s"] = pred[row["layout"]]["tokens_per_s"]
        row["predicted_bottleneck"] = pred[row["layout"]]["bottleneck"]
    base, pbase = rows[0]["tokens_per_s"], rows[0]["predicted_tokens_per_s"]
    for row in rows:
        row["measured_ratio"] = row["tokens_per_s"] / base
        row["predicted_ratio"] = row["predicted_tokens_per_s"] / pbase
    meta = {
        "cpus": os.cpu_count(),
        "threads_per_process": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "gemm_flops_per_s": rate,
        "command": "python benchmarks/bench_distributed.py",
        "settings": SETTINGS,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distributed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Disaggregated training on this CPU ({meta['date']}, {meta['cpus']} CPUs, 1 thread per process, "
        f"torch {meta['torch']})",
        "",
        f"`{meta['command']}`; tiny target, {', '.join(SETTINGS)}.",
        "Steady tokens/s = tokens of steps 2..N over (wall of the N-step launch - wall of a 1-step launch).",
        f"Planner: throughput model with this CPU's one-thread matmul rate ({rate / 1e9:.1f} GFLOP/s) as peak, "
        f"times cores/processes where {meta['cpus']} cores are shared by more processes.",
        "",
        "| layout | tokens/s | vs 1 process | predicted vs 1 process | predicted bottleneck | drafter wait | "
        "MB/s received |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wait = f"{r['drafter_wait_fraction']:.0%}" if r["drafter_wait_fraction"] is not None else "-"
        mb = f"{r['recv_bytes_per_s'] / 1e6:.1f}" if r.get("recv_bytes_per_s") else "-"
        lines.append(
            f"| {r['layout']} | {r['tokens_per_s']:.0f} | {r['measured_ratio']:.2f}x | "
            f"{r['predicted_ratio']:.2f}x | {r['predicted_bottleneck']} | {wait} | {mb} |"
        )
    (RESULTS / "distributed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
