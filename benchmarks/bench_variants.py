"""DFlash vs DSpark vs DFlash2 on the embedded tiny target, at the demo's data and budget.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_variants.py [--seeds 0 1] [--out DIR] [--variants dspark]
    # writes benchmarks/results/variants.{json,md}; with --variants, the other variants' runs are
    # kept from the results file (each run records the date and command that measured it)

The demo's pipeline (``commands/demo.py``) regenerates the held-out stdlib responses with the target
once; then every (variant, seed) trains the tiny-demo preset (same steps, data and schedule; only
``drafter.variant`` and ``train.seed`` change) and is scored on the same held-out rows:
teacher-forced chain tau, decode-path tau, DDTree tau at budgets 16 and 64, per-slot acceptance,
chain tau at T = 1 (expected, exact), and for DSpark the confidence head's calibration per slot
(mean predicted vs mean measured acceptance a = sum_v min(p_v, q_v) over the held-out rows' slots),
and for DFlash2 the candidate recall per slot (the target's greedy token among the selector's K).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from demo_bench import demo_data, kept_runs, results_header, train_on_demo_data

from dflash_trainer.inference.acceptance import acceptance_report
from dflash_trainer.inference.regenerate import eos_ids
from dflash_trainer.inference.sampled_acceptance import chain_tau_both_ways
from dflash_trainer.training.step import draft_loss, drafter_step, produce_row_features

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ["dflash", "dspark", "dflash2"]


def calibration(trainer, cfg, rows) -> dict | None:
    """Per slot: mean predicted acceptance (confidence head) vs mean measured a, on held-out rows."""
    d = trainer.drafter
    if not hasattr(d, "confidence_head"):
        return None
    sums = None
    d.eval()
    with torch.no_grad():
        for i, row in enumerate(rows):
            feats = produce_row_features(trainer.target, row, 10_000_000 + i, cfg)
            if feats is None:
                continue
            _, m = draft_loss(d, drafter_step(d, feats, cfg, train=False), cfg)
            c = m["confidence_per_slot"]
            sums = c if sums is None else {k: sums[k] + c[k] for k in c}
    n = sums["rows"].clamp(min=1)
    return {"predicted": (sums["predicted"] / n).tolist(), "measured": (sums["measured"] / n).tolist()}


def command_line(args) -> str:
    return (
        "PYTHONPATH=src .venv/bin/python benchmarks/bench_variants.py --seeds "
        + " ".join(map(str, args.seeds))
        + f" --prompts-per-file {args.prompts_per_file} --max-steps {args.max_steps}"
        + (f" --variants {' '.join(args.variants)}" if args.variants != list(VARIANTS) else "")
    )


def write_results(args, root: Path, results: list, t0: float) -> None:
    """benchmarks/results/variants.{json,md} from the runs so far."""
    RESULTS.mkdir(exist_ok=True)
    info = {**results_header(root, command_line(args), t0), "torch_threads": torch.get_num_threads(), "runs": results}
    (RESULTS / "variants.json").write_text(json.dumps(info, indent=1) + "\n")
    lines = [
        "# DFlash vs DSpark vs DFlash2 on the tiny target (demo data and budget)",
        "",
        f"`{info['command']}` ({info['date']}, {info['torch_threads']} torch threads, {info['total_seconds']} s).",
        f"Same regenerated data ({info['records']['train']} training / {info['records']['eval']} held-out records), "
        f"{args.max_steps} steps of the tiny-demo preset (block 8); held-out rows as the demo scores them.",
        "DSpark: markov_rank 256, vanilla head, sample_from_anchor (B = 8 drafts a block, DFlash: 7), confidence head.",
        "DFlash2: convolutions of 2 taps, groups of 16 channels; selector rank 256, top 16 (7 drafts a block).",
        ""
        if args.prompts_per_file == 4
        else f"Fewer prompts than the demo ({args.prompts_per_file} per held-out file instead of 4): the machine was "
        "shared and regenerating the demo's 340 responses did not fit the time; the training budget is the demo's.",
        "",
        "| variant | seed | tau (teacher-forced) | decode-path tau | DDTree-16 | DDTree-64 | tau T=1 (expected) | params | train s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "command" in r:
            lines.append(f"| (kept: measured {r['date']} by `{r['command']}`) | | | | | | | | |")
        lines.append(
            f"| {r['variant']} | {r['seed']} | {r['tau']:.3f} | {r['decode_tau']:.3f} | {r['ddtree_tau']['16']:.3f} | "
            f"{r['ddtree_tau']['64']:.3f} | {r['tau_t1_expected']:.3f} | {r['params']:,} | {r['train_seconds']} |"
        )
    lines += ["", "Per-slot acceptance (teacher-forced, greedy):", ""]
    for r in results:
        lines.append(f"- {r['variant']} seed {r['seed']}: " + " ".join(f"{a:.2f}" for a in r["slot_acceptance"]))
    lines += [
        "",
        "Confidence calibration (DSpark, per slot: mean predicted / mean measured acceptance a = sum_v min(p_v, q_v)):",
        "teacher-forced as in training (previous tokens from the data), and along the Markov walk as `eval` reports",
        "it (previous tokens drafted, as decoding uses the head):",
        "",
    ]
    for r in results:
        for key, what in (("calibration", "teacher-forced"), ("eval_confidence", "eval, along the walk")):
            c = r.get(key)
            if c:
                pairs = " ".join(f"{p:.2f}/{m:.2f}" for p, m in zip(c["predicted"], c["measured"]))
                lines.append(f"- seed {r['seed']}, {what}: {pairs}")
    recalls = [r for r in results if r.get("candidate_recall")]
    if recalls:
        lines += [
            "",
            "Candidate recall (DFlash2, per slot: the target's greedy token among the unary top K, held out):",
            "",
        ]
        for r in recalls:
            c = r["candidate_recall"]
            lines.append(
                f"- seed {r['seed']}: " + " ".join(f"{x:.2f}" for x in c["per_slot"]) + f" (mean {c['mean']:.3f})"
            )
    (RESULTS / "variants.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", default="runs/bench-variants")
    ap.add_argument("--prompts-per-file", type=int, default=4, help="the demo's default: 4 (340 prompts)")
    ap.add_argument("--max-steps", type=int, default=800, help="the demo's default: 800")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    root = Path(args.out)
    t0 = time.time()
    demo_data(root, args.prompts_per_file, ("train.dtype=bfloat16",))
    results = kept_runs(RESULTS / "variants.json", "variant", args.variants, list(VARIANTS))
    for variant in args.variants:
        for seed in args.seeds:
            settings = [f"drafter.variant={variant}", f"train.seed={seed}", "train.dtype=bfloat16"]
            cfg, target, trainer, rows, seconds = train_on_demo_data(
                root, root / f"{variant}-s{seed}", [*settings, f"train.max_steps={args.max_steps}"]
            )
            rep = acceptance_report(target, trainer.drafter, rows, budgets=[16, 64], decode_path=True)
            t1_tau = chain_tau_both_ways(
                target, trainer.drafter, rows, eos_ids(target.model, trainer.tokenizer), temperature=1.0
            )
            results.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "train_seconds": round(seconds, 1),
                    "params": sum(p.numel() for p in trainer.drafter.parameters()),
                    "tau": rep["tau"],
                    "decode_tau": rep["decode_tau"],
                    "ddtree_tau": dict(zip(map(str, rep["budgets"]), rep["ddtree_tau"])),
                    "slot_acceptance": rep["slot_acceptance"],
                    "blocks": rep["blocks"],
                    "tau_t1_expected": t1_tau["expected"],
                    "calibration": calibration(trainer, cfg, rows),
                    "eval_confidence": rep.get("confidence"),
                    "candidate_recall": rep.get("candidate_recall"),
                }
            )
            print(json.dumps(results[-1]), flush=True)
            write_results(args, root, results, t0)  # after every run: an interrupted benchmark keeps what it measured


if __name__ == "__main__":
    main()
