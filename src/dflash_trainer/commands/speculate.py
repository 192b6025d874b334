"""``dflash-train speculate``: real speculative decoding of prompts, checked against the target alone.

    dflash-train speculate --drafter CKPT --input prompts.jsonl --output out.jsonl [--mode chain|ddtree]
                           [--budget N ...] [--max-new-tokens N] [--limit N]
                           [--temperature T] [--top-p P] [--seed S]

Each prompt (the conversation up to its first assistant turn) is decoded greedily by the target alone
and speculatively (``inference.speculate_bench``); the outputs must agree token for token. With
``--temperature T > 0`` both sample instead (speculative sampling, ``inference.sampling``: lossless in
distribution, so the outputs are not compared token for token; prompt i uses seed ``S + i``). Writes
``OUT`` (one record per prompt: text, tau per mode) and ``OUT.report.json`` (tau, tokens/s, speedup,
mismatches per mode), both atomically.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config.cli_args import add_config_args, positive_int, resolve_config
from ..errors import UserError
from ..io import atomic_write_json, atomic_write_text


def run_speculate(args: argparse.Namespace) -> int:
    """Decode each prompt with the target alone and speculatively, check they agree token for token,
    report tau, tokens/s and the speedup; exit status 1 when any output differs."""
    from ..config import TargetConfig
    from ..data.records import iter_records
    from ..export.layouts import drafter_meta, load_any_drafter
    from ..inference.prompts import chat_prompts
    from ..inference.regenerate import eos_ids
    from ..inference.speculate_bench import speculate_bench
    from ..model.loading import load_target_model

    cfg = resolve_config(args)
    budgets = args.budget or [64]
    if any(b < 1 for b in budgets):
        raise UserError(f"--budget must be >= 1, got {min(budgets)}")
    # written so that NaN fails them (every comparison with NaN is false): no check is silently skipped
    if not (args.temperature >= 0 and args.temperature != float("inf")):
        raise UserError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 <= args.confidence_threshold <= 1:
        raise UserError(f"--confidence-threshold must be in [0, 1], got {args.confidence_threshold}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    sampling = args.temperature > 0
    meta = drafter_meta(args.drafter)  # a checkpoint, or a z-lab / speculators drafter folder
    target_cfg = (
        cfg.target
        if cfg.target.path != "tiny" or meta["target"].get("path") in (None, "tiny")
        else TargetConfig(path=meta["target"]["path"], dtype=cfg.target.dtype)
    )
    target, tok = load_target_model(target_cfg, layer_ids=meta["target"]["layer_ids"])
    model = target.model
    drafter, _ = load_any_drafter(args.drafter, target, dtype=model.dtype)
    eos = eos_ids(model, tok)
    prompts = chat_prompts(iter_records(args.input), tok, args.limit)
    if not prompts:
        raise UserError("no prompts: the input has no chat record with an assistant turn")
    if args.confidence_threshold > 0 and not hasattr(drafter, "confidence_head"):
        raise UserError(f"--confidence-threshold needs a drafter with a confidence head; {args.drafter} has none")
    bench = speculate_bench(
        target,
        drafter,
        tok,
        prompts,
        eos,
        mode=args.mode,
        budgets=budgets,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        confidence_threshold=args.confidence_threshold,
    )
    summary = bench.summary
    how = f"sampling at T={args.temperature:g}, top-p {args.top_p:g}" if sampling else "greedy"
    print(f"{len(prompts)} prompts, target-only {how}: {summary['target_tokens_per_s']:.1f} tokens/s")
    for name, s in summary["modes"].items():
        agreement = "" if sampling else f", outputs differing from target greedy: {s['mismatches']}"
        saved = f", target tokens saved: {s['target_tokens_saved']}" if "target_tokens_saved" in s else ""
        print(
            f"{name:>12}: tau {s['tau']:.2f}, {s['tokens_per_s']:.1f} tokens/s, speedup {s['speedup']:.2f}x"
            f"{agreement}{saved}"
        )
    out = Path(args.output)
    atomic_write_text(out, "".join(json.dumps(r) + "\n" for r in bench.records))
    report = atomic_write_json(out.with_name(out.name + ".report.json"), summary)
    print(f"report: {report}")
    return 1 if bench.mismatches else 0


def add_speculate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "speculate",
        help="speculative decoding with a drafter (chain or DDTree), checked against the target alone",
        description="Decode each prompt greedily with the target alone and speculatively with --drafter; check "
        "that the outputs agree token for token and report tau, tokens/s and the speedup. With --temperature T > 0 "
        "both sample instead (speculative sampling: the drafts are the drafter's, the target samples every verified "
        "position and the walk follows its samples, so the output is distributed as the target's own sampling).",
    )
    add_config_args(
        p,
        default_preset="tiny-demo",
        set_help="dotted override, e.g. --set target.path=/models/qwen (default: the checkpoint's target)",
    )
    p.add_argument(
        "--drafter",
        metavar="CHECKPOINT",
        required=True,
        help="drafter checkpoint, or a z-lab / speculators drafter folder",
    )
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PATH",
        help="chat JSONL (file or folder); each record's turns before its first assistant turn are a prompt",
    )
    p.add_argument("--output", required=True, metavar="OUT.jsonl", help="one output record per prompt")
    p.add_argument("--mode", choices=["chain", "ddtree"], default="chain", help="verification (default chain)")
    p.add_argument(
        "--budget",
        type=int,
        action="append",
        default=None,
        metavar="N",
        help="DDTree node budget; repeat for several (default 64)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per prompt (default 256)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the first N prompts")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 (default): greedy, checked token for token; T > 0: speculative sampling, lossless in distribution",
    )
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling with T > 0 (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; prompt i uses seed + i (default 0)")
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        metavar="C",
        help="DSpark: stop a block's chain where the confidence head's cumulative predicted acceptance falls "
        "below C (0, the default: off); the report counts the target tokens saved",
    )
    p.set_defaults(func=run_speculate)
    return p
