"""``dflash-train config`` and ``dflash-train presets``: the resolved config, the valid keys, the settings'
reference, the presets."""

from __future__ import annotations

import argparse
import sys

from ..config import dump_config, preset_names, valid_keys
from ..config.cli_args import add_config_args, resolve_config
from ..config.loader import preset_description


def run_config(args: argparse.Namespace) -> int:
    if args.keys:
        print("\n".join(valid_keys()))
        return 0
    if args.reference:
        from ..config.reference import markdown_reference

        print(markdown_reference())
        return 0
    sys.stdout.write(dump_config(resolve_config(args)))
    return 0


def run_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        print(f"{name:20s} {preset_description(name)}")
    return 0


def add_config_parsers(subparsers) -> None:
    p = subparsers.add_parser("config", help="print the fully resolved config as YAML")
    add_config_args(p, default_preset=None)
    p.add_argument("--keys", action="store_true", help="list every valid dotted key instead")
    p.add_argument(
        "--reference", action="store_true", help="print every setting's type, default and description (Markdown)"
    )
    p.set_defaults(func=run_config)
    p = subparsers.add_parser("presets", help="list the built-in presets")
    p.set_defaults(func=run_presets)
