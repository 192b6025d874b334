"""Training recipes side by side on the embedded tiny target, at the demo's data and budget.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_recipes.py [--seeds 0 1] [--jobs 2] [--recipes muon dpace]
    # writes benchmarks/results/recipes.{json,md}; with --recipes, the other recipes' runs are kept from
    # the results file (each run records the date and command that measured it)

The demo's pipeline (``commands/demo.py``) regenerates the held-out stdlib responses with the target
once; then every (recipe, seed) trains the tiny-demo preset in fp32 with the same steps, rows, anchors
and tokens (equal compute: only the optimizer, schedule, position weights and loss terms change) and
is scored on the same held-out rows: teacher-forced chain tau, decode-path tau, DDTree tau at budget
16 and the per-slot acceptance. Every recipe spells out all the settings it compares, so the table
does not move when the project's defaults do. ``--jobs`` runs that many trainings at once, one torch
thread each (the numbers of a run do not depend on it; its seconds do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from demo_bench import demo_data, kept_and_slot_lines, kept_runs, results_header, train_on_demo_data

RESULTS = Path(__file__).resolve().parent / "results"

# The settings compared; every recipe sets all of them, so that a recipe means the same whatever the
# defaults are. "adamw" is this project's recipe before issue 35 (AdamW, cosine, DFlash's exp-decay
# slot weights); "speculators" is speculators 0.9.0's DFlash default (Muon, D-PACE, linear decay,
# 1% warmup, weight decay 0.01) at this project's learning rate; "dpace+muon+wsd", the best measured,
# is the project's default since (config/schema.py).
BASE = {
    "train.optimizer": "adamw",
    "train.schedule": "cosine",
    "train.warmup_ratio": 0.04,
    "train.weight_decay": 0.0,
    "train.muon_weight_decay": 0.1,
    "loss.position_weights": "exp_decay",
    "loss.tv_weight": 0.0,
}
RECIPES = {
    "adamw": {},
    "dpace": {"loss.position_weights": "dpace"},
    "muon": {"train.optimizer": "muon"},
    "dpace+muon": {"train.optimizer": "muon", "loss.position_weights": "dpace"},
    "wsd": {"train.schedule": "wsd"},
    "linear": {"train.schedule": "linear"},
    "tv": {"loss.tv_weight": 0.5},
    "dpace+muon+tv": {"train.optimizer": "muon", "loss.position_weights": "dpace", "loss.tv_weight": 0.5},
    "dpace+muon+wsd": {"train.optimizer": "muon", "loss.position_weights": "dpace", "train.schedule": "wsd"},
    "dpace+muon+linear": {"train.optimizer": "muon", "loss.position_weights": "dpace", "train.schedule": "linear"},
    "speculators": {
        "train.optimizer": "muon",
        "loss.position_weights": "dpace",
        "train.schedule": "linear",
        "train.warmup_ratio": 0.01,
        "train.weight_decay": 0.01,
        "train.muon_weight_decay": 0.01,
    },
}


def overrides(recipe: str) -> list[str]:
    return [f"{k}={v}" for k, v in {**BASE, **RECIPES[recipe]}.items()]


def run_one(root: Path, recipe: str, seed: int, max_steps: int) -> dict:
    """Train one (recipe, seed) in this process and score it; returns its result row."""
    import torch

    from dflash_trainer.inference.acceptance import acceptance_report

    out = root / f"{recipe}-s{seed}"
    settings = [f"train.seed={seed}", "train.dtype=float32", f"train.max_steps={max_steps}", *overrides(recipe)]
    _, target, trainer, rows, seconds = train_on_demo_data(root, out, settings)
    rep = acceptance_report(target, trainer.drafter, rows, budgets=[16], decode_path=True)
    return {
        "recipe": recipe,
        "seed": seed,
        "settings": RECIPES[recipe],
        "train_seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "tau": rep["tau"],
        "decode_tau": rep["decode_tau"],
        "ddtree16_tau": rep["ddtree_tau"][0],
        "slot_acceptance": rep["slot_acceptance"],
        "blocks": rep["blocks"],
    }


def command_line(args) -> str:
    cmd = "PYTHONPATH=src .venv/bin/python benchmarks/bench_recipes.py --seeds " + " ".join(map(str, args.seeds))
    cmd += f" --jobs {args.jobs} --max-steps {args.max_steps}"
    return cmd + (f" --recipes {' '.join(args.recipes)}" if args.recipes != list(RECIPES) else "")


def mean(xs):
    return sum(xs) / len(xs)


def write_results(args, root: Path, runs: list, t0: float) -> None:
    """benchmarks/results/recipes.{json,md} from the runs so far."""
    RESULTS.mkdir(exist_ok=True)
    info = {**results_header(root, command_line(args), t0), "base": BASE, "runs": runs}
    (RESULTS / "recipes.json").write_text(json.dumps(info, indent=1) + "\n")
    by_recipe: dict[str, list] = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r)
    base_tau = mean([r["tau"] for r in by_recipe["adamw"]]) if "adamw" in by_recipe else None
    lines = [
        "# Training recipes on the tiny target (demo data and budget, equal compute)",
        "",
        f"`{info['command']}` ({info['date']}, {info['total_seconds']} s).",
        f"Same regenerated data ({info['records']['train']} training / {info['records']['eval']} held-out records), "
        f"{args.max_steps} steps of the tiny-demo preset (block 8, 32 anchors per row) in fp32; held-out rows as the "
        "demo scores them. Every recipe starts from: " + ", ".join(f"`{k}={v}`" for k, v in BASE.items()) + ".",
        "",
        "| recipe | changes | tau per seed (teacher-forced) | mean tau | vs adamw | decode-path tau | DDTree-16 | train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for recipe, rs in by_recipe.items():
        taus = [r["tau"] for r in rs]
        vs = f"{mean(taus) - base_tau:+.3f}" if base_tau is not None else ""
        changes = ", ".join(f"`{k}={v}`" for k, v in RECIPES.get(recipe, rs[0]["settings"]).items()) or "(none)"
        lines.append(
            f"| {recipe} | {changes} | {' / '.join(f'{t:.3f}' for t in taus)} | {mean(taus):.3f} | {vs} | "
            f"{mean([r['decode_tau'] for r in rs]):.3f} | {mean([r['ddtree16_tau'] for r in rs]):.3f} | "
            f"{mean([r['train_seconds'] for r in rs]):.0f} |"
        )
    lines += kept_and_slot_lines(runs, by_recipe)
    (RESULTS / "recipes.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--jobs", type=int, default=1, help="trainings at once, one torch thread each")
    ap.add_argument("--out", default="runs/bench-recipes")
    ap.add_argument("--max-steps", type=int, default=800, help="the demo's default: 800")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--one", nargs=2, metavar=("RECIPE", "SEED"), help=argparse.SUPPRESS)  # a worker's job
    args = ap.parse_args()
    root = Path(args.out)
    if args.one:
        print(json.dumps(run_one(root, args.one[0], int(args.one[1]), args.max_steps)), flush=True)
        return

    t0 = time.time()
    demo_data(root)
    runs = kept_runs(RESULTS / "recipes.json", "recipe", args.recipes, list(RECIPES))
    todo = [(recipe, seed) for recipe in args.recipes for seed in args.seeds]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else dict(os.environ)
    running: list[tuple[subprocess.Popen, str, int]] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            recipe, seed = todo.pop(0)
            cmd = [sys.executable, __file__, "--out", str(root), "--max-steps", str(args.max_steps)]
            cmd += ["--one", recipe, str(seed)]
            running.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True), recipe, seed))
            print(f"started {recipe} seed {seed}", flush=True)
        time.sleep(2)
        for job in [j for j in running if j[0].poll() is not None]:
            running.remove(job)
            proc, recipe, seed = job
            out = proc.stdout.read().strip().splitlines()
            if proc.returncode != 0 or not out:
                raise SystemExit(f"{recipe} seed {seed} failed (exit {proc.returncode})")
            runs.append(json.loads(out[-1]))
            print(out[-1], flush=True)
            runs.sort(key=lambda r: (list(RECIPES).index(r["recipe"]) if r["recipe"] in RECIPES else 99, r["seed"]))
            write_results(args, root, runs, t0)  # after every run: an interrupted benchmark keeps what it measured


if __name__ == "__main__":
    main()
