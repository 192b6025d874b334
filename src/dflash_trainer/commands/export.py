"""``dflash-train export``: a drafter checkpoint in a serving format, or ``--check`` of an export
(``--serve vllm``: also served by the real vLLM, its greedy output and acceptance against ours)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import TargetConfig
from ..config.cli_args import positive_int
from ..drafter_folder import read_checkpoint_config
from ..errors import UserError
from ..export.formats import check_export, export_checkpoint
from ..model.loading import load_target


def run_export(args: argparse.Namespace) -> int:
    if args.check:
        if args.paths:
            raise UserError("--check takes the exported folder as its value: dflash-train export --check OUT")
        report = check_export(args.check, args.target, args.checkpoint)
        for line in report.notes:
            print(f"note: {line}")
        for line in report.problems:
            print(f"problem: {line}")
        problems = list(report.problems)
        if args.serve == "vllm" and not problems:
            problems += serve_check(args.check, args.target, args.input, args.limit, args.max_new_tokens)
        print(f"{args.check}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if args.serve:
        raise UserError("--serve goes with --check: dflash-train export --check OUT --serve vllm")
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


SERVE_TAU_RTOL = 0.02  # vLLM's acceptance vs ours (tests/test_vllm_serving.py measures ~0.2-0.9%)


def serve_check(folder: str, target_path: str | None, inputs: list[str] | None, limit: int, max_new: int) -> list[str]:
    """Serve the export ``folder`` with vLLM (``serving.launch``) and decode the same prompts with this
    project's speculative decoder: vLLM's greedy output must be the target's plain greedy output, and
    its tau (1 + accepted / drafts) ours within 2%. Problems, one line each; the numbers are printed."""
    from ..config import TargetConfig
    from ..data.records import iter_records
    from ..export.formats import read_export, recorded_verifier, resolve_verifier
    from ..export.layouts import drafter_meta, load_any_drafter
    from ..inference.prompts import chat_prompts
    from ..inference.regenerate import eos_ids
    from ..inference.speculative import SpeculativeDecoder, target_greedy
    from ..model.loading import load_target_model, resolve_target_path
    from ..serving.launch import run_vllm, vllm_python, vllm_tau
    from .demo import build_prompts

    python = vllm_python()  # before any model is loaded: a missing vLLM costs nothing
    fmt, _, _, _, cfg = read_export(Path(folder))
    named = recorded_verifier(fmt, cfg)
    tdir = resolve_target_path(target_path) if target_path else (resolve_verifier(named) if named else None)
    if tdir is None:
        raise UserError("the export names no loadable target; pass --target PATH")
    target, tok = load_target_model(
        TargetConfig(path=str(tdir), dtype="float32"), drafter_meta(folder)["target"]["layer_ids"]
    )
    drafter, _ = load_any_drafter(Path(folder), target)
    records = iter_records(inputs) if inputs else build_prompts(1)
    prompts = [ids for _, ids in chat_prompts(records, tok, limit)]
    if not prompts:
        raise UserError("--serve needs chat prompts: the --input has no chat record with an assistant turn")
    eos = eos_ids(target.model, tok)
    decoder = SpeculativeDecoder(target, drafter, eos)
    greedy, rounds, accepted = [], 0, 0
    for ids in prompts:
        greedy.append(target_greedy(target.model, ids, max_new, eos)[0])
        res = decoder.generate(ids, max_new)
        rounds, accepted = rounds + len(res.accepted), accepted + sum(res.accepted)
    ours = 1 + accepted / rounds
    # vLLM's engine core in the runner's process: a check, not a throughput figure, and 20 s sooner
    # than spawning it (4.7 s of engine start instead of 23 s on the tiny target, 2 cores)
    served = run_vllm(tdir, prompts, max_new, {"export": Path(folder)}, python=python, in_process=True)["export"]
    if "error" in served:
        return [f"vLLM refuses to serve {folder}: {served['error']}"]
    same = sum(a == b for a, b in zip(served["tokens"], greedy))
    theirs = vllm_tau(served)
    print(
        f"vllm: {same}/{len(prompts)} outputs equal to plain greedy; tau {theirs:.3f} over {served['drafts']} "
        f"draft steps vs ours {ours:.3f} over {rounds} rounds ({100 * (theirs / ours - 1):+.2f}%)"
    )
    problems = []
    if same < len(prompts):
        problems.append(f"vLLM's output with this drafter differs from plain greedy on {len(prompts) - same} prompt(s)")
    if abs(theirs / ours - 1) > SERVE_TAU_RTOL:
        problems.append(
            f"vLLM's acceptance (tau {theirs:.3f}) differs from ours ({ours:.3f}) by more than "
            f"{100 * SERVE_TAU_RTOL:.0f}%: vLLM computes this drafter differently (layer ids, windows, norm?)"
        )
    return problems


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
    p.add_argument(
        "--serve",
        choices=["vllm"],
        default=None,
        help="with --check: serve the export with vLLM (DFLASH_VLLM_PYTHON or this python) and compare its "
        "greedy output and acceptance with this project's speculative decoding",
    )
    p.add_argument("--input", action="append", default=None, metavar="PATH", help="with --serve: chat JSONL prompts")
    p.add_argument("--limit", type=positive_int, default=8, help="with --serve: prompts to decode (default 8)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="with --serve: tokens per prompt (default 128)"
    )
    p.add_argument("paths", nargs="*", metavar="CHECKPOINT OUT")
    p.set_defaults(func=run_export)
    return p
