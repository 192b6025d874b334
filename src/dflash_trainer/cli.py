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
import gc
import sys
from collections.abc import Callable

from . import __version__
from .errors import UserError

# command -> (module of commands/, the function that registers it); a module may register several
COMMANDS = {
    "demo": ("demo", "add_demo_parser"),
    "train": ("train", "add_train_parser"),
    "prepare-data": ("prepare_data", "add_prepare_data_parser"),
    "capture": ("capture", "add_capture_parser"),
    "generate": ("generate", "add_generate_parser"),
    "speculate": ("speculate", "add_speculate_parser"),
    "eval": ("eval", "add_eval_parser"),
    "plan": ("plan", "add_plan_parser"),
    "export": ("export", "add_export_parser"),
    "config": ("config", "add_config_parsers"),
    "presets": ("config", "add_config_parsers"),
    "tiny-target": ("tiny_target", "add_tiny_target_parser"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, when ``argv`` names one, of that command alone: a command's
    module imports what it runs on (torch, transformers: 3 s of a process's start), and a command
    needs only its own (``config --set`` answers in 0.2 s, a bad override in a script fails fast)."""
    import importlib

    named = next((a for a in (argv or []) if not a.startswith("-")), None)
    registrars = dict.fromkeys(COMMANDS.values())  # one call per registering function, in table order
    if named in COMMANDS:
        registrars = {COMMANDS[named]: None}
    parser = argparse.ArgumentParser(prog="dflash-train", description="Train DFlash drafters for speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dflash-trainer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module, function in registrars:
        getattr(importlib.import_module(f".commands.{module}", __package__), function)(sub)
    return parser


def one_line(text: str) -> str:
    """``text`` with every character that could break the line or the terminal (newlines, U+2028,
    control characters, lone surrogates from a hostile input echoed in a message) written as an escape."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"dflash-train: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-train: interrupted", file=sys.stderr)
        return 130


# Full collections of the garbage collector a process's start runs (importing torch, transformers and a
# model's module, building the model): Python runs one each time the long-lived heap grows by a quarter,
# and each walks all of it (seven in a one-step tiny-target training, 0.74 of its 4.75 CPU-s).
STARTUP_COLLECTIONS = 8


def freeze_startup_heap(collections: int | None = STARTUP_COLLECTIONS) -> Callable[[], None]:
    """Leave what survives each of the process's next ``collections`` full collections (``None``: until
    stopped) out of every later one (``gc.freeze``, as vLLM freezes its engine's heap once started):
    imported modules, the model, the config, which live as long as the process. Each full collection of
    the start then walks only what was made since the last: a one-step tiny-target training spends
    0.15 CPU-s collecting instead of 0.74, and its process 4.0 s of user CPU instead of 5.1 (three runs
    each, side by side). Objects that die later are still freed by their reference counts; only a
    reference cycle among objects frozen here would outlive its use. Called once, by the process's
    entry point (``entry`` and ``python -m``), never by ``main``: a caller of ``main`` in its own
    process keeps its collector. Returns a function that stops it (tests/conftest.py: once the test
    files are collected)."""
    left = [collections]

    def freeze_survivors(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            gc.freeze()
            if left[0] is not None:
                left[0] -= 1
                if left[0] == 0:
                    stop()

    def stop() -> None:
        if freeze_survivors in gc.callbacks:
            gc.callbacks.remove(freeze_survivors)

    gc.callbacks.append(freeze_survivors)
    return stop


def entry() -> None:
    """The ``dflash-train`` executable (pyproject's ``[project.scripts]``)."""
    freeze_startup_heap()
    sys.exit(main())


if __name__ == "__main__":
    entry()
