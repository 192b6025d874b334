"""The memory planner, predicted versus measured, over real CPU training steps and target forwards.

    .venv/bin/python benchmarks/bench_planner.py            # writes benchmarks/results/planner.{json,md}
    .venv/bin/python benchmarks/bench_planner.py --quick    # the two cases tests/test_planner.py runs

Each case builds a synthetic Qwen3 target (random weights, the given shape) and either runs one real
``Trainer.train_step`` (target and drafter on the CPU, after one warm-up step so AdamW's states
exist) or one ``TargetModel.features`` call, in a fresh process. The measurement is the CPU
allocator's event log (``torch.profiler`` with ``profile_memory=True``; see
``benchmarks/planner_measure.py``) plus the tensors alive at the start; the prediction is the
planner's for the same config on a CPU device with the same thread count. GPU-only paths
(FlexAttention's compiled kernel, CUDA's foreach AdamW, the runtime reserve) are predictions only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from planner_measure import THREADS, Case, measure_in_subprocess, predict_case

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.10


def _o(**kw) -> tuple[str, ...]:
    return tuple(f"{k.replace('__', '.')}={v}" for k, v in kw.items())


_TINY = dict(
    hidden=256, intermediate=768, vocab=8192, layers=8, heads=4, kv_heads=2, head_dim=64
)  # the tiny target's shape
_F32 = dict(train__dtype="float32", target__dtype="float32")
_BF16 = dict(train__dtype="bfloat16", target__dtype="bfloat16")

CASES: list[tuple[Case, str]] = [
    (
        Case(
            "S1",
            "step",
            **_TINY,
            overrides=_o(
                data__seq_len=512,
                data__max_anchors=32,
                drafter__block_size=8,
                drafter__num_layers=2,
                loss__gamma=4.0,
                **_F32,
            ),
        ),
        "tiny-demo preset on the tiny target's shape: 512 tokens, 32 x 8, 2 layers, fp32, CE",
    ),
    (
        Case(
            "S2",
            "step",
            overrides=_o(
                data__seq_len=1024,
                data__max_anchors=64,
                drafter__block_size=8,
                drafter__num_layers=2,
                loss__kl_weight=0.15,
                loss__cap_weight=0.1,
                **_BF16,
            ),
        ),
        "bf16 autocast, CE + 15% KL + CAP, loss chunk from the fused loss's default budget",
    ),
    (
        Case(
            "S3",
            "step",
            hidden=128,
            intermediate=1024,
            vocab=1024,
            overrides=_o(
                data__seq_len=1024,
                data__max_anchors=128,
                drafter__block_size=8,
                drafter__num_layers=3,
                loss__chunk_size=64,
                **_F32,
            ),
        ),
        "fp32, 1,024 queries through a wide MLP: activations and backward dominate",
    ),
    (
        Case(
            "S4",
            "step",
            vocab=2048,
            overrides=_o(
                data__seq_len=4096,
                data__max_anchors=16,
                drafter__block_size=8,
                drafter__num_layers=2,
                drafter__sliding_window_layers="[0]",
                drafter__sliding_window=512,
                drafter__noise="uniform",
                drafter__noise_scale=0.05,
                loss__chunk_size=64,
                **_BF16,
            ),
        ),
        "bf16, 4,096-token row with 128 queries, sliding window on layer 0, uniform noise",
    ),
    (
        Case(
            "S5",
            "step",
            overrides=_o(
                data__seq_len=1024,
                data__max_anchors=32,
                drafter__block_size=8,
                drafter__num_layers=2,
                loss__kl_weight=0.5,
                loss__temperature=2.0,
                train__grad_accum=2,
                **_F32,
            ),
        ),
        "fp32, KL at T=2, gradient accumulation over 2 rows",
    ),
    (
        Case(
            "S6",
            "step",
            hidden=128,
            intermediate=1024,
            vocab=1024,
            overrides=_o(
                data__seq_len=2048,
                data__max_anchors=64,
                drafter__block_size=8,
                drafter__num_layers=3,
                loss__chunk_size=64,
                drafter__activation_checkpointing="true",
                **_BF16,
            ),
        ),
        "bf16, activation checkpointing, 3 layers",
    ),
    (
        Case(
            "S7",
            "step",
            hidden=128,
            intermediate=1024,
            vocab=1024,
            overrides=_o(
                data__seq_len=2048,
                data__max_anchors=64,
                drafter__block_size=8,
                drafter__num_layers=3,
                loss__chunk_size=64,
                loss__labels="teacher",
                drafter__sliding_window_layers="[0,1]",
                drafter__sliding_window=256,
                drafter__causal_in_block_sliding="true",
                drafter__activation_checkpointing="true",
                **_F32,
            ),
        ),
        "fp32, checkpointing, teacher labels, causal sliding-window layers",
    ),
    (
        Case(
            "S8",
            "step",
            constant_tokens=True,
            warmup_steps=12,
            overrides=_o(
                data__seq_len=1024,
                data__max_anchors=64,
                drafter__block_size=8,
                drafter__num_layers=2,
                loss__kl_weight=0.15,
                loss__cap_weight=0.1,
                loss__chunk_size=128,
                **_BF16,
            ),
        ),
        "bf16, CAP after 12 steps on a one-token row: every row correct, CAP's extra work at its worst",
    ),
    (
        Case(
            "S9",
            "step",
            hybrid=True,
            docs=1,
            overrides=_o(
                data__seq_len=2048,
                data__max_anchors=32,
                drafter__block_size=8,
                drafter__num_layers=2,
                loss__kl_weight=0.15,
                **_BF16,
            ),
        ),
        "bf16, Qwen3.5-style hybrid target (Gated DeltaNet, torch fallback), one 2,048-token document",
    ),
    (
        Case(
            "S10",
            "step",
            **_TINY,
            overrides=_o(
                data__seq_len=16384,
                data__max_anchors=512,
                drafter__block_size=8,
                drafter__num_layers=2,
                loss__kl_weight=0.15,
                loss__cap_weight=0.1,
                drafter__noise="uniform",
                drafter__noise_scale=0.05,
                **_BF16,
            ),
        ),
        "GB scale: tiny target's shape, 16,384-token row, 512 x 8, bf16, noise, KL + CAP",
    ),
    (
        Case("T1", "target", overrides=_o(data__seq_len=2048, loss__kl_weight=0.15, **_F32)),
        "fp32 target, 2,048 tokens in 3 documents (packed mask), all layers (teacher needed)",
    ),
    (
        Case("T2", "target", overrides=_o(data__seq_len=2048, **_BF16)),
        "bf16 target, packed row, early exit after the last hooked layer",
    ),
    (
        Case("T3", "target", docs=1, overrides=_o(data__seq_len=4096, **_BF16)),
        "bf16 target, one 4,096-token document (no mask), early exit",
    ),
    (
        Case("T4", "target", hidden=256, intermediate=768, docs=4, overrides=_o(data__seq_len=2048, **_F32)),
        "fp32 target, hidden 256, 4 documents",
    ),
    (
        Case("T5", "target", overrides=_o(data__seq_len=4096, loss__kl_weight=0.15, **_BF16)),
        "bf16 target, 4,096 tokens packed, all layers",
    ),
    (
        Case("T6", "target", **_TINY, overrides=_o(data__seq_len=1024, loss__kl_weight=0.15, **_F32)),
        "the tiny target's shape, 1,024 tokens, all layers",
    ),
    (
        Case("T7", "target", hybrid=True, docs=1, overrides=_o(data__seq_len=4096, loss__kl_weight=0.15, **_BF16)),
        "bf16 Qwen3.5-style hybrid target (6 Gated DeltaNet + 2 gated attention layers), one 4,096-token document",
    ),
]
QUICK = ("S1", "S6")


def run(case: Case) -> dict:
    t0 = time.perf_counter()
    measured = measure_in_subprocess(case)
    predicted = predict_case(case, measured.get("accuracy"))
    m, p = measured["peak"], predicted["peak"]
    return {
        "case": case.name,
        "kind": case.kind,
        "overrides": list(case.overrides),
        "shape": {
            k: getattr(case, k)
            for k in ("hidden", "intermediate", "vocab", "layers", "heads", "kv_heads", "head_dim", "docs")
        },
        "measured_peak_bytes": m,
        "predicted_peak_bytes": p,
        "error": p / m - 1,
        "measured_start_bytes": measured["start"],
        "predicted_start_bytes": predicted["start"],
        "measured_extra_bytes": m - measured["start"],
        "predicted_extra_bytes": p - predicted["start"],
        "extra_error": (p - predicted["start"]) / max(1, m - measured["start"]) - 1,
        "measured_phases": measured.get("phases", {}),
        "predicted_phases": predicted.get("phases", {}),
        "predicted_peak_phase": predicted.get("peak_phase"),
        "measured_peak_phase": max(measured["phases"], key=measured["phases"].get) if measured.get("phases") else None,
        "accuracy": measured.get("accuracy"),
        "seconds": time.perf_counter() - t0,
    }


def markdown(rows: list[dict], meta: dict, descriptions: dict[str, str]) -> str:
    mb = 2**20
    worst = max(abs(r["error"]) for r in rows)
    lines = [
        f"# Memory planner: predicted vs measured ({meta['date']}, {meta['cpus']} CPUs, {meta['threads']} threads, "
        f"torch {meta['torch']})",
        "",
        f"`{meta['command']}`. Each case is a fresh process on a synthetic target (Qwen3, or Qwen3.5-style hybrid "
        'with Gated DeltaNet layers) with random weights; "measured" is the CPU allocator\'s peak (torch.profiler '
        "allocation events, kernels' internal temporaries included) plus the tensors alive at the start; "
        '"predicted" is `dflash_trainer.planner` for the same config on this CPU (same thread count). Extra = peak '
        "minus what was alive at the start of the step (weights, AdamW states). CAP's extra work takes the measured "
        "share of correct rows as input (plans assume all rows correct). Tolerance: 10% on the peak.",
        "",
        "| case | what | measured MB | predicted MB | error | extra measured / predicted MB | extra error | "
        "peak phase measured / predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mp = r["measured_peak_phase"] or "forward"
        pp = r["predicted_peak_phase"] or "forward"
        lines.append(
            f"| {r['case']} | {descriptions[r['case']]} | {r['measured_peak_bytes'] / mb:.1f} | "
            f"{r['predicted_peak_bytes'] / mb:.1f} | {r['error']:+.1%} | {r['measured_extra_bytes'] / mb:.1f} / "
            f"{r['predicted_extra_bytes'] / mb:.1f} | {r['extra_error']:+.1%} | {mp} / {pp} |"
        )
    lines += [
        "",
        f"Largest peak error: {worst:.1%} (tolerance {TOLERANCE:.0%}); "
        f"{sum(abs(r['error']) <= TOLERANCE for r in rows)} of {len(rows)} cases within it.",
        "",
    ]
    steps = [r for r in rows if r["kind"] == "step"]
    if steps:
        lines += [
            "Per phase (training steps), measured / predicted MB:",
            "",
            "| case | target forward | drafter forward | loss | backward | optimizer |",
            "|---|---|---|---|---|---|",
        ]
        for r in steps:
            cells = []
            for ph in ("target forward", "drafter forward", "loss", "backward", "optimizer"):
                m, p = r["measured_phases"].get(ph), r["predicted_phases"].get(ph)
                cells.append(f"{m / mb:.1f} / {p / mb:.1f}" if m is not None and p is not None else "-")
            lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "Not measured here (no GPU): FlexAttention's compiled kernels, CUDA's foreach AdamW, the CUDA runtime "
        "reserve and the caching allocator's fragmentation margin; the planner's GPU numbers are predictions.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--jobs", type=int, default=2, help="cases measured at once (each in its own process)")
    parser.add_argument("--render", action="store_true", help="only re-render results/planner.md from planner.json")
    args = parser.parse_args()
    descriptions = {c.name: d for c, d in CASES}
    if args.render:
        data = json.loads((RESULTS / "planner.json").read_text())
        (RESULTS / "planner.md").write_text(markdown(data["rows"], data["meta"], descriptions))
        return 0
    chosen = [(c, d) for c, d in CASES if not args.quick or c.name in QUICK]
    # The planner's parameter count imports these lazily; transformers' lazy module is not safe to
    # resolve from two threads at once (an ImportError), so resolve them here first.
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda cd: run(cd[0]), chosen))
    for r in rows:
        print(
            f"{r['case']}: measured {r['measured_peak_bytes'] / 2**20:.1f} MB, predicted "
            f"{r['predicted_peak_bytes'] / 2**20:.1f} MB ({r['error']:+.1%}); {r['seconds']:.0f} s",
            flush=True,
        )
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "threads": THREADS,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "command": "python benchmarks/bench_planner.py" + (" --quick" if args.quick else ""),
        "tolerance": TOLERANCE,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = "planner_quick" if args.quick else "planner"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(rows, meta, descriptions))
    print(markdown(rows, meta, descriptions))
    return 0 if all(abs(r["error"]) <= TOLERANCE for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
