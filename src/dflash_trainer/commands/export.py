"""``dflash-train export``: a drafter checkpoint in a serving format, or ``--check`` of an export."""

from __future__ import annotations

import argparse

from ..config import TargetConfig
from ..errors import UserError
from ..export.formats import check_export, export_checkpoint
from ..model.loading import load_target
from ..training.checkpoint import read_checkpoint_config


def run_export(args: argparse.Namespace) -> int:
    if args.check:
        if args.paths:
            raise UserError("--check takes the exported folder as its value: dflash-train export --check OUT")
        report = check_export(args.check, args.target, args.checkpoint)
        for line in report.notes:
            print(f"note: {line}")
        for line in report.problems:
            print(f"problem: {line}")
        print(f"{args.check}: {'OK' if not report.problems else f'{len(report.problems)} problem(s)'}")
        return 1 if report.problems else 0
    if len(args.paths) != 2 or not args.format:
        raise UserError("usage: dflash-train export --format zlab|speculators CHECKPOINT OUT (or --check OUT)")
    checkpoint, out = args.paths
    target_model = None
    if args.format == "speculators":
        path = args.target or read_checkpoint_config(checkpoint)["target"].get("path")
        target_model, _, _ = load_target(TargetConfig(path=path, dtype="float32"))
    folder = export_checkpoint(
        checkpoint,
        out,
        args.format,
        target_model=target_model,
        verifier=args.verifier,
        allow_mismatch=args.allow_mismatch,
    )
    print(f"exported {checkpoint} as {args.format} to {folder}")
    return 0


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="export a drafter checkpoint for serving (zlab, speculators), or check an export"
    )
    p.add_argument("--format", choices=["zlab", "speculators"])
    p.add_argument("--check", metavar="OUT", default=None, help="validate an exported folder against its target")
    p.add_argument("--target", default=None, help="target folder (default: the one the checkpoint or export names)")
    p.add_argument(
        "--verifier",
        metavar="NAME_OR_PATH",
        default=None,
        help="what the export names as its target/verifier: a hub name or local folder "
        "(default: the checkpoint's target as an absolute local folder)",
    )
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="export settings the format's serving stack computes differently; the export's README says what differs",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="with --check: the checkpoint for the numeric check (default: the recorded one)",
    )
    p.add_argument("paths", nargs="*", metavar="CHECKPOINT OUT")
    p.set_defaults(func=run_export)
    return p
