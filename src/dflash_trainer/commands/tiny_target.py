"""``dflash-train tiny-target eval|build``: the embedded tiny target's held-out quality, or a rebuild."""

from __future__ import annotations

import argparse


def run_tiny_target(args: argparse.Namespace) -> int:
    if args.action == "build":
        from ..tiny_target.build import main as build_main

        return build_main(args.rest)
    from ..tiny_target.report import main as report_main

    return report_main(args.rest)


def add_tiny_target_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tiny-target", help="evaluate or rebuild the embedded tiny target")
    p.add_argument("action", choices=["eval", "build"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the action (see --help of each)")
    p.set_defaults(func=run_tiny_target)
    return p
