"""What the benchmarks that train on the demo's data share (bench_recipes.py, bench_variants.py, bench_on_policy.py).

The demo's regenerated data made once under ``ROOT/data``; one training of the tiny-demo preset on it
with extra overrides; the runs of an earlier invocation that this one does not rerun, kept with the
date and command that measured them; the header facts of a results file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def demo_data(root: Path, prompts_per_file: int = 4, overrides: tuple[str, ...] = ()) -> None:
    """The demo's regenerated train/eval records under ``root/data`` (made once, the tiny-demo preset
    with ``overrides``); the overrides that train on them."""
    data = root / "data"
    if not (data / "eval.jsonl").exists():
        from dflash_trainer.commands.demo import run_demo
        from dflash_trainer.config import load_config

        cfg = load_config(["tiny-demo"], [f"output_dir={data}", "train.max_steps=1", *overrides])
        run_demo(cfg, prompts_per_file=prompts_per_file)


def train_on_demo_data(root: Path, out: Path, overrides: list[str]):
    """Train the tiny-demo preset on ``root``'s demo data (made by ``demo_data``) into ``out``.

    Returns (cfg, target, trainer, held-out rows as the demo scores them, training seconds)."""
    from dflash_trainer.config import load_config
    from dflash_trainer.training.setup import prepare
    from dflash_trainer.training.trainer import Trainer

    data = [f"data.train_files=[{root / 'data' / 'train.jsonl'}]", f"data.eval_files=[{root / 'data' / 'eval.jsonl'}]"]
    cfg = load_config(["tiny-demo"], [*data, f"output_dir={out}", *overrides])
    target, tok, train_rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, train_rows, eval_rows, out_dir=out, target_path="tiny", progress=False)
    t0 = time.time()
    trainer.fit(overwrite=True)
    return cfg, target, trainer, eval_rows[: cfg.data.max_eval_rows], time.time() - t0


def kept_runs(results_json: Path, key: str, rerun: list[str], every: list[str]) -> list[dict]:
    """The runs in ``results_json`` whose ``key`` (recipe, variant) is not in ``rerun``, each with the
    date and command that measured it; none when this invocation reruns ``every`` one."""
    if rerun == every or not results_json.is_file():
        return []
    old = json.loads(results_json.read_text())
    return [
        {**r, "date": r.get("date", old["date"]), "command": r.get("command", old["command"])}
        for r in old["runs"]
        if r[key] not in rerun
    ]


def kept_and_slot_lines(runs: list[dict], by_key: dict[str, list[dict]]) -> list[str]:
    """The closing lines of a results table: the earlier invocations whose runs were kept (``kept_runs``)
    and each key's per-slot acceptance, the mean over its seeds."""
    lines = []
    kept = sorted({(r["date"], r["command"]) for r in runs if "command" in r})
    if kept:
        lines += ["", "Kept from earlier invocations: " + "; ".join(f"`{c}` ({d})" for d, c in kept) + "."]
    lines += ["", "Per-slot acceptance (teacher-forced, greedy; mean over seeds):", ""]
    for key, rs in by_key.items():
        if rs:
            slots = [sum(col) / len(col) for col in zip(*[r["slot_acceptance"] for r in rs])]
            lines.append(f"- {key}: " + " ".join(f"{a:.2f}" for a in slots))
    return lines


def results_header(root: Path, command: str, t0: float) -> dict:
    """The facts every results file opens with: command, machine, data records, date, seconds so far."""
    import torch

    data = root / "data"
    return {
        "command": command,
        # the vector instructions torch's CPU kernels use: what a rerun must match to repeat the numbers
        "machine": f"{os.cpu_count()} CPU cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}",
        "records": {split: sum(1 for _ in open(data / f"{split}.jsonl")) for split in ("train", "eval")},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "total_seconds": round(time.time() - t0, 1),
    }
