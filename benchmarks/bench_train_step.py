"""Tokens/s of a full training step on the tiny target: fused loss vs the plain reference loss.

    .venv/bin/python benchmarks/bench_train_step.py   # writes benchmarks/results/train_step.{json,md}

Same rows, same drafter, same anchors for both variants, alternating runs in one process. A step
is target features + anchors/blocks + drafter forward + loss + backward + AdamW, on packed rows of
the tiny-demo preset (and a larger-row variant), with CE + 15% soft KL + CAP on.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflash_trainer.config import load_config
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.step import draft_loss, drafter_step, produce_row_features
from dflash_trainer.training.trainer import Trainer

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = [
    ("tiny-demo (512 tokens, 32 x 8)", []),
    ("tiny-demo, 2048-token rows, 128 x 8", ["data.seq_len=2048", "data.max_anchors=128"]),
]


def main() -> None:
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    data = tmp / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Continue `{f.relpath}`:"},
                        {"role": "assistant", "content": f.text[:6000]},
                    ]
                }
            )
            + "\n"
            for f in load_split("train", limit=60)
        )
    )
    rows_out = []
    for name, overrides in LAYOUTS:
        cfg = load_config(
            ["tiny-demo"],
            [
                *overrides,
                f"data.train_files=[{data}]",
                f"output_dir={tmp / 'run'}",
                "loss.kl_weight=0.15",
                "loss.cap_weight=0.1",
            ],
        )
        target, tok, rows, eval_rows, _ = prepare(cfg)
        trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp / "run", target_path="tiny", progress=False)
        times = {"fused": [], "reference": []}
        for rep in range(7):
            for variant in ("fused", "reference"):
                row = rows[rep % len(rows)]
                t0 = time.perf_counter()
                trainer.optimizer.zero_grad(set_to_none=True)
                batch = drafter_step(trainer.drafter, produce_row_features(target, row, rep, cfg), cfg, train=True)
                loss, _ = draft_loss(trainer.drafter, batch, cfg, reference=variant == "reference")
                loss.backward()
                trainer.optimizer.step()
                if rep:  # the first repetition is the warm-up
                    times[variant].append(time.perf_counter() - t0)
        tokens = cfg.data.seq_len
        result = {
            "layout": name,
            "tokens_per_step": tokens,
            "query_rows": cfg.data.max_anchors * cfg.drafter.block_size,
        }
        for variant, ts in times.items():
            result[f"{variant}_step_s"] = statistics.median(ts)
            result[f"{variant}_tokens_per_s"] = tokens / statistics.median(ts)
        result["speedup"] = result["reference_step_s"] / result["fused_step_s"]
        rows_out.append(result)
        print(result, flush=True)
    meta = {
        "cpus": os.cpu_count(),
        "threads": 2,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_train_step.py",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_step.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=2) + "\n")
    lines = [
        f"# Training step on the tiny target ({meta['date']}, {meta['cpus']} CPUs, 2 threads, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; CE + 15% KL + CAP 0.1; median of 6 steps after a warm-up, variants alternating.",
        "",
        "| layout | query rows | fused step s | fused tokens/s | reference step s | reference tokens/s | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows_out:
        lines.append(
            f"| {r['layout']} | {r['query_rows']} | {r['fused_step_s']:.3f} | {r['fused_tokens_per_s']:.0f} | "
            f"{r['reference_step_s']:.3f} | {r['reference_tokens_per_s']:.0f} | {r['speedup']:.2f}x |"
        )
    (RESULTS / "train_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
