"""``dflash-train plan``: predict the memory of a training run on each device, before launch."""

from __future__ import annotations

import argparse
import json
import sys

from ..config.cli_args import add_config_args, resolve_config
from ..planner.report import plan_for_config, render_json, render_text
from ..planner.shapes import TARGET_PRESETS


def _int_arg(name):
    def parse(text):
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None

    return parse


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dflash-train plan`` on the CLI's sub-parsers (``func`` is set)."""
    p = subparsers.add_parser("plan", help="predict the memory of a training run on each device, before launch")
    add_config_args(p, default_preset=None)
    p.add_argument(
        "--target",
        default=None,
        metavar="PRESET|PATH",
        help=f"target to price: {', '.join(TARGET_PRESETS)}, tiny, a model folder or a config.json "
        "(default: target.path, else topology.target_model)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="PRESET|GB",
        help="memory per GPU: rtx-pro-6000, h100, h200, a100-80gb, l40s, or GB (default: topology.gpu)",
    )
    p.add_argument(
        "--target-gpus",
        type=_int_arg("--target-gpus"),
        default=None,
        metavar="N",
        help="GPUs running target replicas; 0 = target on the drafter's device (default: topology.target_ranks)",
    )
    p.add_argument(
        "--drafter-gpus",
        type=_int_arg("--drafter-gpus"),
        default=None,
        metavar="N",
        help="GPUs training the drafter (default: topology.drafter_ranks)",
    )
    p.add_argument(
        "--naive",
        action="store_true",
        help="price the pipeline without this project's fixes (full logits, full-row verifier logits)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
    return p


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    plan = plan_for_config(
        cfg,
        target=args.target,
        gpu=args.gpu,
        target_gpus=args.target_gpus,
        drafter_gpus=args.drafter_gpus,
        naive=args.naive,
    )
    if args.json:
        json.dump(render_json(plan), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(plan))
    return 0
