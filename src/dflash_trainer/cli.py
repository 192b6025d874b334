"""The ``dflash-train`` command line.

    dflash-train demo     [--config FILE|PRESET ...] [--set KEY=VALUE ...]   train a drafter on the tiny target
    dflash-train train    --config FILE|PRESET [--set ...] [--resume auto]    train a drafter
    dflash-train generate --input DATA --output OUT.jsonl [--config ...]      regenerate responses with the target
    dflash-train config   [--config ...] [--set ...] [--keys]                 print the resolved config
    dflash-train presets                                                      list built-in presets
    dflash-train eval     CHECKPOINT [...] --data DATA --out DIR               acceptance: chain tau, DDTree tau(budget)
    dflash-train plan     --config PRESET [--gpu h100] [--json] [--naive]     will it fit? what does?
    dflash-train export   --format zlab|speculators CHECKPOINT OUT | --check OUT
    dflash-train tiny-target eval|build                                       the embedded tiny target

Every user error (bad config, missing file, bad override) ends with one line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from . import __version__
from .config import dump_config, preset_names, valid_keys
from .config.cli_args import add_config_args, resolve_config
from .errors import UserError


def _cmd_config(args: argparse.Namespace) -> int:
    if args.keys:
        print("\n".join(valid_keys()))
        return 0
    sys.stdout.write(dump_config(resolve_config(args)))
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        text = (resources.files("dflash_trainer") / "presets" / f"{name}.yaml").read_text(encoding="utf-8")
        first = next((line[1:].strip() for line in text.splitlines() if line.startswith("#")), "")
        print(f"{name:20s} {first}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(resolve_config(args), max_new_tokens=args.max_new_tokens, prompts_per_file=args.prompts_per_file)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .run_train import run_training

    run_training(resolve_config(args), resume=None if args.resume == "none" else args.resume, progress=not args.no_progress,
                 overwrite=args.overwrite)
    return 0


def _cmd_tiny_target(args: argparse.Namespace) -> int:
    if args.action == "build":
        from .tiny_target.build import main as build_main

        return build_main(args.rest)
    from .tiny_target.report import main as report_main

    return report_main(args.rest)


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import check_export, export_checkpoint

    if args.check:
        if args.paths:
            raise UserError("--check takes the exported folder as its value: dflash-train export --check OUT")
        problems = check_export(args.check, args.target)
        for line in problems:
            print(f"problem: {line}")
        print(f"{args.check}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if len(args.paths) != 2 or not args.format:
        raise UserError("usage: dflash-train export --format zlab|speculators CHECKPOINT OUT (or --check OUT)")
    checkpoint, out = args.paths
    target_model = None
    if args.format == "speculators":
        from .checkpoint import read_checkpoint_config
        from .config import TargetConfig
        from .target_loading import load_target

        path = args.target or read_checkpoint_config(checkpoint)["target"].get("path")
        target_model, _, _ = load_target(TargetConfig(path=path, dtype="float32"))
    folder = export_checkpoint(checkpoint, out, args.format, target_model=target_model)
    print(f"exported {checkpoint} as {args.format} to {folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-train", description="Train DFlash drafters for speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dflash-trainer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="train a drafter on the embedded tiny target end to end (no input needed)")
    add_config_args(p, default_preset="tiny-demo")
    p.add_argument("--max-new-tokens", type=int, default=160, help="length of each regenerated response")
    p.add_argument("--prompts-per-file", type=int, default=4, help="prompts cut from each held-out stdlib file")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="train a drafter (data.train_files: JSONL chat or pre-tokenized records)")
    add_config_args(p, default_preset=None)
    p.add_argument("--resume", default="none", metavar="auto|PATH|none",
                   help="auto: continue from the newest complete checkpoint in output_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.jsonl)")
    p.add_argument("--overwrite", action="store_true", help="start over in an output_dir that holds checkpoints")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("config", help="print the fully resolved config as YAML")
    add_config_args(p, default_preset=None)
    p.add_argument("--keys", action="store_true", help="list every valid dotted key instead")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("presets", help="list the built-in presets")
    p.set_defaults(func=_cmd_presets)

    from .evaluate import add_eval_parser
    from .generate import add_generate_parser
    from .planner import add_plan_parser

    add_generate_parser(sub)
    add_eval_parser(sub)
    add_plan_parser(sub)

    p = sub.add_parser("export", help="export a drafter checkpoint for serving (zlab, speculators), or check an export")
    p.add_argument("--format", choices=["zlab", "speculators"])
    p.add_argument("--check", metavar="OUT", default=None, help="validate an exported folder against its target")
    p.add_argument("--target", default=None, help="target folder (default: the one the checkpoint or export names)")
    p.add_argument("paths", nargs="*", metavar="CHECKPOINT OUT")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("tiny-target", help="evaluate or rebuild the embedded tiny target")
    p.add_argument("action", choices=["eval", "build"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the action (see --help of each)")
    p.set_defaults(func=_cmd_tiny_target)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"dflash-train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-train: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
