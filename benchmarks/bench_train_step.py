"""Tokens/s of a full training step on the tiny target: fused loss vs the plain reference loss, in
fp32 and under bf16 autocast, against the step's own GEMM floor.

    .venv/bin/python benchmarks/bench_train_step.py   # writes benchmarks/results/train_step.{json,md}
    .venv/bin/python benchmarks/bench_train_step.py --variants dflash dspark dflash2
        # the drafter variants side by side: step time and peak memory (train_step_variants.{json,md})

Same rows, same drafter, same anchors for every variant, alternating runs in one process. A step
is target features + anchors/blocks + drafter forward + loss + backward + AdamW, on packed rows of
the tiny-demo preset (and a larger-row variant), with CE + 15% soft KL + CAP on.

GEMM floor: one step runs under a dispatch recorder that lists every matrix product it executes
(mm, addmm, bmm, and attention as its QK^T and PV products: 2 forward, 4 backward), with shapes
and dtypes: target forward, drafter forward and backward, the loss's head GEMMs. The floor is the
time of exactly those products run back to back by ``torch.mm``/``torch.bmm`` on preallocated
tensors, timed in the same process interleaved with the steps; efficiency = floor / step time
(median of the per-repetition ratios). What the step spends beyond the floor is the element-wise
work, the optimizer, Python and data preparation: the next bottleneck.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class GemmRecorder(TorchDispatchMode):
    """Lists the matrix products an interval executes: ``(kind, a shape, b shape, dtype)``."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm"):
            self.calls.append((name, tuple(args[0].shape), tuple(args[1].shape), args[0].dtype))
        elif name in ("addmm", "baddbmm"):
            self.calls.append(
                (
                    name.removeprefix("add").removeprefix("bad"),
                    tuple(args[1].shape),
                    tuple(args[2].shape),
                    args[1].dtype,
                )
            )
        elif "scaled_dot_product" in name:  # q [.., Lq, d], k/v [.., Lk, d]: QK^T and PV
            q, k = args[0], args[1]
            if name.endswith("backward"):
                q, k = args[1], args[2]  # (grad_out, q, k, v, ...)
            b = q.shape[:-2].numel()
            lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
            qk, pv = ("bmm", (b, lq, d), (b, d, lk), q.dtype), ("bmm", (b, lq, lk), (b, lk, d), q.dtype)
            self.calls += [qk, pv, qk, pv] if name.endswith("backward") else [qk, pv]
        return func(*args, **(kwargs or {}))


def gemm_floor_runner(calls: list[tuple]):
    """A function that runs exactly ``calls``' products on preallocated tensors; and their FLOPs."""
    work, flops = [], 0
    for kind, a_shape, b_shape, dtype in calls:
        a, b = torch.randn(a_shape).to(dtype), torch.randn(b_shape).to(dtype)
        out = torch.empty(*a_shape[:-1], b_shape[-1], dtype=dtype)
        work.append((torch.mm if kind == "mm" else torch.bmm, a, b, out))
        flops += 2 * a.numel() * b_shape[-1]

    def run():
        for fn, a, b, out in work:
            fn(a, b, out=out)

    return run, flops


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7, help="repetitions per variant; the first is the warm-up")
    parser.add_argument("--quick", action="store_true", help="the first layout only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", help="compare these drafter variants (tiny-demo layout, fp32) instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
    if args.variants:
        return compare_variants(args, data, tmp)
    rows_out = []
    for name, overrides in LAYOUTS[:1] if args.quick else LAYOUTS:
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
        cfgs = {
            "float32": cfg.model_copy(update={"train": cfg.train.model_copy(update={"dtype": "float32"})}),
            "bfloat16": cfg.model_copy(update={"train": cfg.train.model_copy(update={"dtype": "bfloat16"})}),
        }

        def step(rep: int, dtype: str, reference: bool = False):
            c = cfgs[dtype]
            row = rows[rep % len(rows)]
            trainer.zero_grad()
            batch = drafter_step(trainer.drafter, produce_row_features(target, row, rep, c), c, train=True)
            loss, _ = draft_loss(trainer.drafter, batch, c, reference=reference)
            loss.backward()
            trainer.optimizer_step()

        floors = {}
        for dtype in cfgs:  # the products one step executes (row 0; every row has the same padded shapes)
            with GemmRecorder() as rec:
                step(0, dtype)
            floors[dtype] = gemm_floor_runner(rec.calls)
        variants = {
            "fused fp32": lambda rep: step(rep, "float32"),
            "reference fp32": lambda rep: step(rep, "float32", reference=True),
            "floor fp32": lambda rep: floors["float32"][0](),
            "fused bf16": lambda rep: step(rep, "bfloat16"),
            "floor bf16": lambda rep: floors["bfloat16"][0](),
        }
        times = {name: [] for name in variants}
        for rep in range(args.reps):
            for variant, fn in variants.items():
                t0 = time.perf_counter()
                fn(rep)
                if rep:  # the first repetition is the warm-up
                    times[variant].append(time.perf_counter() - t0)
        tokens = cfg.data.seq_len
        result = {
            "layout": name,
            "tokens_per_step": tokens,
            "query_rows": cfg.data.max_anchors * cfg.drafter.block_size,
        }
        for variant, ts in times.items():
            key = variant.replace(" ", "_")
            result[f"{key}_step_s"] = statistics.median(ts)
            if not variant.startswith("floor"):
                result[f"{key}_tokens_per_s"] = tokens / statistics.median(ts)
        for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
            ratios = [f / t for f, t in zip(times[f"floor {short}"], times[f"fused {short}"])]
            result[f"efficiency_{short}"] = statistics.median(ratios)
            result[f"floor_gflop_{short}"] = floors[dtype][1] / 1e9
        result["speedup"] = result["reference_fp32_step_s"] / result["fused_fp32_step_s"]
        result["bf16_speedup"] = result["fused_fp32_step_s"] / result["fused_bf16_step_s"]
        rows_out.append(result)
        print(result, flush=True)
    meta = run_meta(
        args,
        "python benchmarks/bench_train_step.py"
        + (f" --reps {args.reps}" if args.reps != 7 else "")
        + (" --quick" if args.quick else "")
        + (f" --threads {args.threads}" if args.threads != 2 else ""),
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_step.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=2) + "\n")
    lines = [
        f"# Training step on the tiny target ({meta['date']}, {meta['cpus']} CPUs, {meta['threads']} threads, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; CE + 15% KL + CAP 0.1; median of {meta['reps'] - 1} steps after a warm-up, variants alternating; "
        f"load average (1 min) at the end {meta['load_average_1min_at_end']:.1f} on {meta['cpus']} CPUs. "
        "GEMM floor: every matrix product of one step (target forward, drafter forward + backward, loss head "
        "GEMMs; attention as QK^T and PV) run back to back by torch.mm/bmm, timed interleaved with the steps; "
        "efficiency = floor / step (median of per-repetition ratios).",
        "",
        "| layout | query rows | dtype | fused step s | tokens/s | GEMM floor s (GFLOP) | efficiency | reference step s | speedup vs reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows_out:
        for short in ("fp32", "bf16"):
            ref = f"{r['reference_fp32_step_s']:.3f}" if short == "fp32" else "-"
            speed = f"{r['speedup']:.2f}x" if short == "fp32" else f"{r['bf16_speedup']:.2f}x vs fused fp32"
            lines.append(
                f"| {r['layout']} | {r['query_rows']} | {short} | {r[f'fused_{short}_step_s']:.3f} | "
                f"{r[f'fused_{short}_tokens_per_s']:.0f} | {r[f'floor_{short}_step_s']:.3f} "
                f"({r[f'floor_gflop_{short}']:.1f}) | {r[f'efficiency_{short}']:.0%} | {ref} | {speed} |"
            )
    (RESULTS / "train_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def run_meta(args, command: str) -> dict:
    """What a results file records about the run: machine, threads, torch, date, load, repetitions."""
    return {
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1min_at_end": os.getloadavg()[0],
        "reps": args.reps,
        "command": command,
    }


def compare_variants(args, data: Path, tmp: Path) -> None:
    """One trainer per drafter variant on the same rows (the tiny-demo layout, fp32, CE + 15% KL + CAP),
    steps alternating between the variants; then each variant's peak memory of one step from the CPU
    allocator's own events (``planner_measure.allocator_peak``, after the warm-up so that AdamW's states
    exist), plus the bytes of the tensors alive before the step."""
    from planner_measure import allocator_peak, live_tensor_bytes

    trainers, cfgs = {}, {}
    for variant in args.variants:
        cfg = load_config(
            ["tiny-demo"],
            [
                f"data.train_files=[{data}]",
                f"output_dir={tmp / variant}",
                f"drafter.variant={variant}",
                "loss.kl_weight=0.15",
                "loss.cap_weight=0.1",
            ],
        )
        target, tok, rows, eval_rows, _ = prepare(cfg)
        torch.manual_seed(0)
        trainers[variant] = (
            Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp / variant, target_path="tiny", progress=False),
            rows,
        )
        cfgs[variant] = cfg

    def step(variant: str, rep: int):
        trainer, rows = trainers[variant]
        c = cfgs[variant]
        trainer.zero_grad()
        batch = drafter_step(
            trainer.drafter, produce_row_features(trainer.target, rows[rep % len(rows)], rep, c), c, train=True
        )
        loss, _ = draft_loss(trainer.drafter, batch, c)
        loss.backward()
        trainer.optimizer_step()

    times = {v: [] for v in args.variants}
    for rep in range(args.reps):
        for variant in args.variants:
            t0 = time.perf_counter()
            step(variant, rep)
            if rep:
                times[variant].append(time.perf_counter() - t0)
    out = []
    for variant in args.variants:
        start = live_tensor_bytes()
        _, peak, _ = allocator_peak(lambda: step(variant, args.reps))
        trainer = trainers[variant][0]
        out.append(
            {
                "variant": variant,
                "step_s": statistics.median(times[variant]),
                "peak_bytes": start + peak,
                "step_bytes": peak,
                "params": sum(p.numel() for p in trainer.drafter.parameters()),
            }
        )
        print(out[-1], flush=True)
    meta = run_meta(
        args,
        f"python benchmarks/bench_train_step.py --variants {' '.join(args.variants)}"
        + (f" --reps {args.reps}" if args.reps != 7 else ""),
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "train_step_variants.json").write_text(json.dumps({"meta": meta, "rows": out}, indent=2) + "\n")
    base = out[0]
    lines = [
        f"# Training step per drafter variant, tiny target ({meta['date']}, {meta['cpus']} CPUs, {meta['threads']} threads)",
        "",
        f"`{meta['command']}`; tiny-demo layout (512 tokens, 32 anchors x block 8), fp32, CE + 15% KL + CAP 0.1, each "
        f"variant's defaults; median of {meta['reps'] - 1} steps after a warm-up, variants alternating; peak = tensors alive "
        "before the step + the CPU allocator's peak during it (target, drafter, loss, backward, AdamW); load average "
        f"(1 min) at the end {meta['load_average_1min_at_end']:.1f}.",
        "",
        f"| variant | drafter params | step s | vs {base['variant']} | peak MB | step's own MB | vs {base['variant']} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out:
        lines.append(
            f"| {r['variant']} | {r['params']:,} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x | "
            f"{r['peak_bytes'] / 1e6:.1f} | {r['step_bytes'] / 1e6:.1f} | {r['step_bytes'] / base['step_bytes']:.2f}x |"
        )
    (RESULTS / "train_step_variants.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
