"""The ``--config``/``--set`` arguments every sub-command shares, and their resolution."""

from __future__ import annotations

import argparse

from .loader import load_config
from .schema import RunConfig


def positive_int(text: str) -> int:
    """argparse type of a count (prompts, tokens, batch size): an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_config_args(p: argparse.ArgumentParser, default_preset: str | None, set_help: str | None = None) -> None:
    """Repeatable ``--config FILE|PRESET`` (later wins) and ``--set KEY=VALUE`` (after every file)."""
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="FILE|PRESET",
        help="YAML file or built-in preset name; repeat to layer several (later wins)"
        + (f"; default: {default_preset}" if default_preset else ""),
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=set_help or "dotted override applied after all --config files, e.g. --set train.lr=3e-4",
    )
    p.set_defaults(default_preset=default_preset)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Defaults < each ``--config`` (or the sub-command's default preset) < each ``--set``."""
    sources = args.config if args.config is not None else ([args.default_preset] if args.default_preset else [])
    return load_config(sources, args.overrides)
