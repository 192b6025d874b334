"""The ``dflash-train`` command line: one sub-command per module of ``commands/``.

    dflash-train demo      [--config FILE|PRESET ...] [--set KEY=VALUE ...]  train a drafter on the tiny target
    dflash-train train     --config FILE|PRESET [--set ...] [--resume auto]   train a drafter
    dflash-train prepare-data --config FILE [--out DIR] | --verify DIR         tokenize the data once, memory-mapped
    dflash-train capture   --config FILE --out DIR | --verify DIR             run the target once, store its features
    dflash-train generate  --input DATA --output OUT.jsonl [--config ...]     regenerate responses with the target
    dflash-train speculate --drafter CKPT --input DATA --output OUT.jsonl     speculative decoding, lossless check
    dflash-train eval      CHECKPOINT [...] --data DATA --out DIR              acceptance: chain tau, DDTree tau(budget)
    dflash-train plan      --config PRESET [--gpu h100] [--json] [--naive]    will it fit? what does?
    dflash-train export    --format zlab|speculators CHECKPOINT OUT | --check OUT
    dflash-train config    [--config ...] [--set ...] [--keys]                print the resolved config
    dflash-train presets                                                      list built-in presets
    dflash-train tiny-target eval|build                                       the embedded tiny target

Every user error (bad config, missing file, bad override) ends with one line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import UserError


def build_parser() -> argparse.ArgumentParser:
    # Sub-command modules are imported here, not at the top: `import dflash_trainer.cli` stays cheap.
    from .commands.capture import add_capture_parser
    from .commands.config import add_config_parsers
    from .commands.demo import add_demo_parser
    from .commands.eval import add_eval_parser
    from .commands.export import add_export_parser
    from .commands.generate import add_generate_parser
    from .commands.plan import add_plan_parser
    from .commands.prepare_data import add_prepare_data_parser
    from .commands.speculate import add_speculate_parser
    from .commands.tiny_target import add_tiny_target_parser
    from .commands.train import add_train_parser

    parser = argparse.ArgumentParser(prog="dflash-train", description="Train DFlash drafters for speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dflash-trainer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_demo_parser,
        add_train_parser,
        add_prepare_data_parser,
        add_capture_parser,
        add_generate_parser,
        add_speculate_parser,
        add_eval_parser,
        add_plan_parser,
        add_export_parser,
        add_config_parsers,
        add_tiny_target_parser,
    ):
        add(sub)
    return parser


def one_line(text: str) -> str:
    """``text`` with every character that could break the line or the terminal (newlines, U+2028,
    control characters, lone surrogates from a hostile input echoed in a message) written as an escape."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"dflash-train: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
