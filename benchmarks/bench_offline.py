"""Offline training on the tiny target: capture cost, cache size per storage dtype, online vs offline
step time, and the held-out tau of drafters trained online and from fp32 / bf16 / FP8 caches.

Every run is a real ``dflash-train`` process (one intra-op thread, as the distributed tests), on the
tiny-demo preset (its shapes and loss) on the demo's data (``--data``; else records cut from the tiny
target's corpus), the same seed per pair:

    online        train                                   (the target runs every step)
    offline-X     capture --set capture.dtype=X, then train --set data.features=DIR  (X = bf16, FP8;
                  fp32 storage is bit-identical to online, as tests/test_offline.py asserts)

Step time: the median of the per-step wall times in metrics.jsonl (``elapsed_s``), evaluation steps
left out. The ddtree-experiment preset's cache is priced by the planner (``dflash-train plan``).

    dflash-train demo --set train.max_steps=1 --set output_dir=/tmp/demo-data   # the demo's data
    python benchmarks/bench_offline.py --data /tmp/demo-data [--steps 800] [--seeds 0,1]
                                                    # writes benchmarks/results/offline.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))

DTYPES = ("float32", "bfloat16", "float8_e4m3")
# float32 storage of the float32 tiny target is bit-identical to online (tests/test_offline.py): not rerun
TRAINED_FROM = ("bfloat16", "float8_e4m3")
CAPTURE_LINE = re.compile(r"([\d.]+) rows/s, ([\d,]+) tokens/s, ([\d,.]+) MB/s written")


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def cli(*args: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, env=env()
    )
    if result.returncode != 0:
        raise SystemExit(f"dflash-train {' '.join(args[:1])} failed:\n{result.stderr[-3000:]}")
    return result.stdout, time.perf_counter() - t0


def sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def step_stats(run: Path, eval_every: int) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["elapsed_s"] for r in records]
    steps = [
        t1 - t0 for r, t0, t1 in zip(records[1:], times, times[1:]) if r["step"] % eval_every and r["step"] > 2
    ]  # not the first steps (warm-up), not the evaluation steps
    return {
        "step_s_median": statistics.median(steps),
        "eval_tau": [r["eval_tau"] for r in records if "eval_tau" in r][-1],
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    from test_train import write_data

    from dflash_trainer.config import load_config
    from dflash_trainer.planner.report import plan_for_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)  # the demo's budget
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--data", default=None, help="a folder with train.jsonl and eval.jsonl (a demo run's output)")
    ap.add_argument("--render", action="store_true", help="rewrite offline.md from offline.json and exit")
    args = ap.parse_args()
    if args.render:
        (RESULTS / "offline.md").write_text(render(json.loads((RESULTS / "offline.json").read_text())))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    eval_every = args.steps // 2
    work = Path(tempfile.mkdtemp(prefix="bench-offline-"))
    os.environ["DFLASH_DATA_CACHE"] = str(work / "data-cache")
    if args.data:  # the demo's regenerated responses (dflash-train demo writes train.jsonl, eval.jsonl)
        files = [
            f"data.train_files=[{Path(args.data) / 'train.jsonl'}]",
            f"data.eval_files=[{Path(args.data) / 'eval.jsonl'}]",
        ]
    else:
        files = [f"data.train_files=[{write_data(work / 'data.jsonl', n=120, chars=3000)}]"]
    base = [*files, f"train.max_steps={args.steps}", f"train.eval_every={eval_every}", f"train.save_every={args.steps}"]
    data_name = "the demo's regenerated responses" if args.data else "records cut from the tiny target's corpus"
    out = {"steps": args.steps, "seeds": seeds, "data": data_name, "captures": {}, "runs": {}}
    for dtype in DTYPES:
        folder = work / f"features-{dtype}"
        stdout, wall = cli(
            "capture",
            "--config",
            "tiny-demo",
            "--no-progress",
            "--out",
            str(folder),
            *sets([*base, f"capture.dtype={dtype}"]),
        )
        rows_s, tok_s, mb_s = CAPTURE_LINE.search(stdout).groups()
        m = json.loads((folder / "manifest.json").read_text())
        tokens = (m["splits"]["train"] + m["splits"]["eval"]) * m["settings"]["seq_len"]
        out["captures"][dtype] = {
            "rows": m["splits"]["train"] + m["splits"]["eval"],
            "tokens": tokens,
            "bytes": m["bytes"],
            "bytes_per_token": m["bytes"] / tokens,
            "rows_per_s": float(rows_s),
            "tokens_per_s": float(tok_s.replace(",", "")),
            "MB_per_s": float(mb_s.replace(",", "")),
            "command_wall_s": wall,
        }
        print(f"capture {dtype}: {out['captures'][dtype]}", flush=True)
    for seed in seeds:
        for mode in ("online", *[f"offline-{d}" for d in TRAINED_FROM]):
            run = work / f"run-{mode}-{seed}"
            extra = [] if mode == "online" else [f"data.features={work / ('features-' + mode.split('-', 1)[1])}"]
            _, wall = cli(
                "train",
                "--config",
                "tiny-demo",
                "--no-progress",
                *sets([*base, f"train.seed={seed}", f"output_dir={run}", *extra]),
            )
            out["runs"][f"{mode}/{seed}"] = {**step_stats(run, eval_every), "command_wall_s": wall}
            print(f"{mode} seed {seed}: {out['runs'][f'{mode}/{seed}']}", flush=True)
    priced = {}
    for dtype in ("bfloat16", "float8_e4m3"):
        cfg = load_config(["ddtree-experiment"], [f"capture.dtype={dtype}", "topology.gpu=95"])
        c = plan_for_config(cfg).capture
        priced[dtype] = {
            "bytes_per_row": c["bytes_per_row"][dtype],
            "bytes_per_10000_rows": 10_000 * c["bytes_per_row"][dtype],
            "seq_len": c["seq_len"],
            "teacher": c["teacher"],
        }
    out["ddtree_experiment"] = priced
    out["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_at_end": os.getloadavg()[0],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offline.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / "offline.md").write_text(render(out))
    print(render(out))


def render(r: dict) -> str:
    c, runs = r["captures"], r["runs"]
    lines = [
        "# Offline training (tiny target, CPU)",
        "",
        "`dflash-train demo --set train.max_steps=1 --set output_dir=DIR && python benchmarks/bench_offline.py "
        "--data DIR` (one intra-op thread per process; "
        f"{r['steps']} steps, seeds {r['seeds']}, the tiny-demo preset, data: {r['data']}). "
        f"Load average at the end: {r['machine']['load_avg_at_end']:.1f} on {r['machine']['cores']} cores: the "
        "machine was shared with other jobs, so times move from run to run (compare within a seed); the "
        "capture rates include the target forward on one thread.",
        "",
        "| cache | rows | MB | bytes/token | vs bf16 | capture rows/s | tokens/s | MB/s written |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d, v in c.items():
        lines.append(
            f"| {d} | {v['rows']} | {v['bytes'] / 1e6:,.1f} | {v['bytes_per_token']:,.1f} | "
            f"{v['bytes'] / c['bfloat16']['bytes']:.4f} | {v['rows_per_s']:.1f} | {v['tokens_per_s']:,.0f} | {v['MB_per_s']:,.1f} |"
        )
    lines += [
        "",
        "| run | seed | step time (median) | vs online | held-out tau | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in runs.items():
        mode, seed = key.split("/")
        ref = runs[f"online/{seed}"]
        lines.append(
            f"| {mode} | {seed} | {v['step_s_median'] * 1e3:.1f} ms | {v['step_s_median'] / ref['step_s_median']:.2f} | "
            f"{v['eval_tau']:.4f} | {v['final_loss']:.4f} |"
        )
    lines += [
        "",
        "ddtree-experiment (65,536-token rows, k = 5 layers of H = 5,120, teacher stored: its loss has soft KL), "
        "priced by the planner (`dflash-train plan --config ddtree-experiment --set capture.dtype=...`):",
        "",
        "| storage | per row | 10,000 rows |",
        "|---|---|---|",
    ]
    for d, v in r["ddtree_experiment"].items():
        lines.append(f"| {d} | {v['bytes_per_row'] / 1e9:,.2f} GB | {v['bytes_per_10000_rows'] / 1e12:,.2f} TB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
