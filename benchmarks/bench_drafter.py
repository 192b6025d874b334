"""Drafter size and speed on the tiny target (CPU): dense vs flex attention backends side by side.

    .venv/bin/python benchmarks/bench_drafter.py     # writes benchmarks/results/drafter.{json,md}

Layouts: the tiny-demo preset, and the ddtree-experiment drafter (5 layers, block 24, sliding
window on layers 0-3) on a CPU-sized row: the preset's 65,536-token row with 1024 anchors needs a
dense mask of 24,576 x 90,112 and attention scores of 4 x 24,576 x 90,112 fp32 (35 GB), which is
the GPU's flex path, not this CPU's; the row here keeps block 24 and scales rows and anchors down.
FlexAttention has no backward on CPU and runs unfused (eager) here, so flex is timed forward only.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from dflash_trainer.config import load_config
from dflash_trainer.data.blocks import build_blocks, sample_anchors
from dflash_trainer.data.packing import doc_ids_from_positions
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.tiny_target import load_tiny_target

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = [  # (name, preset, overrides for a CPU-sized row)
    ("tiny-demo", "tiny-demo", []),
    (
        "ddtree-experiment (row 4096, 128 anchors)",
        "ddtree-experiment",
        ["target.path=tiny", "data.seq_len=4096", "data.max_anchors=128", "drafter.attention_backend=dense"],
    ),
]


def timed(fn, reps=3):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    model, tok = load_tiny_target()
    rows = []
    for name, preset, overrides in LAYOUTS:
        cfg = load_config([preset], overrides)
        spec = DrafterSpec.from_target(
            model.config, cfg.drafter, num_features=cfg.target.num_feature_layers, mask_token_id=tok.mask_token_id
        )
        torch.manual_seed(0)
        drafter = DFlashDrafter(spec, model.get_input_embeddings(), model.get_output_embeddings().weight).train()
        g = torch.Generator().manual_seed(0)
        length = cfg.data.seq_len
        ids = torch.randint(4, len(tok), (length,), generator=g)
        positions = torch.cat([torch.arange(length // 2), torch.arange(length - length // 2)])  # two documents
        doc = doc_ids_from_positions(positions)
        feats = torch.randn(length, spec.num_features * spec.hidden_size, generator=g)
        anchors = sample_anchors(torch.ones(length, dtype=torch.long), doc, spec.block_size, cfg.data.max_anchors, g)
        blocks = build_blocks(
            ids,
            positions,
            torch.ones(length, dtype=torch.long),
            anchors,
            block_size=spec.block_size,
            mask_token_id=spec.mask_token_id,
            gamma=cfg.loss.gamma,
        )
        row = {
            "layout": name,
            "parameters": sum(p.numel() for p in drafter.parameters()),
            "layers": spec.num_layers,
            "block_size": spec.block_size,
            "anchors": anchors.numel(),
            "query_rows": anchors.numel() * spec.block_size,
            "context_rows": length,
        }
        for backend in ("dense", "flex"):
            row[f"{backend}_mask_s"] = timed(
                lambda: drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, backend), 2
            )
            masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, backend)

            def forward():
                with torch.no_grad():
                    drafter(blocks.input_ids, blocks.position_ids, feats, positions, masks, backend)

            row[f"{backend}_forward_s"] = timed(forward)
        dense_masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense")

        def forward_backward():
            drafter.zero_grad(set_to_none=True)
            out = drafter(blocks.input_ids, blocks.position_ids, feats, positions, dense_masks, "dense")
            out.float().pow(2).mean().backward()

        row["dense_forward_backward_s"] = timed(forward_backward)
        row["flex_forward_backward_s"] = None  # no FlexAttention backward on CPU
        rows.append(row)
        print(row, flush=True)
    meta = {
        "cpus": os.cpu_count(),
        "threads": 2,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_drafter.py",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "drafter.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Drafter benchmark on the tiny target ({meta['date']}, {meta['cpus']} CPUs, 2 threads, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; fp32; median of 3 after a warm-up. Flex runs eager (unfused) on CPU and has no backward there.",
        "",
        "| layout | params | queries x context | dense mask s | flex mask s | dense fwd s | flex fwd s | dense fwd+bwd s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['parameters'] / 1e6:.2f}M | {r['query_rows']} x {r['context_rows']} | "
            f"{r['dense_mask_s']:.3f} | {r['flex_mask_s']:.3f} | {r['dense_forward_s']:.3f} | "
            f"{r['flex_forward_s']:.3f} | {r['dense_forward_backward_s']:.3f} |"
        )
    (RESULTS / "drafter.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
