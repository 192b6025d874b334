"""``dflash-train prepare-data``: tokenize a run's data once, in parallel, into memory-mapped storage.

dflash-train prepare-data --config my-run.yaml --out DATA_DIR    # then --set data.prepared=DATA_DIR
dflash-train prepare-data --config my-run.yaml                   # into the cache train would use
dflash-train prepare-data --verify DATA_DIR                      # every file's sha256
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config.cli_args import add_config_args, resolve_config
from ..errors import UserError


def add_prepare_data_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dflash-train prepare-data`` on the CLI's sub-parsers (``func`` is set)."""
    p = subparsers.add_parser(
        "prepare-data", help="tokenize the configured data once into memory-mapped storage (train reads it)"
    )
    add_config_args(p, default_preset=None)
    p.add_argument("--out", default=None, metavar="DIR", help="folder to write (default: the cache train uses)")
    p.add_argument("--verify", default=None, metavar="DIR", help="check every file of a prepared folder and exit")
    p.set_defaults(func=run_prepare_data)
    return p


def _verify(folder: str) -> int:
    from ..data.storage import PreparedData

    data = PreparedData(folder)  # sizes and index invariants
    problems = data.verify()
    if problems:
        raise UserError(f"{len(problems)} corrupt file(s) in {folder}: {problems[0]}")
    m = data.manifest
    print(
        f"{folder}: ok, {len(m['files'])} files verified; {m['n_tokens']:,} tokens, {m['n_documents']:,} documents, "
        f"{m['splits']['train']['rows']:,} training and {m['splits']['eval']['rows']:,} held-out rows of "
        f"{m['settings']['seq_len']} tokens"
    )
    return 0


def run_prepare_data(args: argparse.Namespace) -> int:
    from ..data.documents import check_report
    from ..data.prepare import ensure_prepared, prepare_data, request_for
    from ..data.records import expand_paths
    from ..data.storage import PreparedData, holds_prepared_data
    from ..model.loading import load_target_config

    if args.verify:
        if args.out or args.config or args.overrides:
            raise UserError("--verify DIR takes no other option")
        return _verify(args.verify)
    cfg = resolve_config(args)
    if not cfg.data.train_files:
        raise UserError("data.train_files is empty: pass --set data.train_files=[path/to/data.jsonl]")
    expand_paths(cfg.data.train_files + cfg.data.eval_files)
    config, tokenizer, _ = load_target_config(cfg.target.path)
    request = request_for(cfg.data, tokenizer, config.vocab_size, min_tokens=cfg.drafter.block_span + 1)
    if args.out:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file, not a folder: choose an empty or new folder")
        # replaced only when it holds prepared data: a feature cache also has a manifest.json
        if out.exists() and any(out.iterdir()) and not holds_prepared_data(out):
            kind = " (it holds a feature cache)" if (out / "capture.json").is_file() else ""
            raise UserError(f"--out {out} exists and is not prepared data{kind}: choose an empty or new folder")
        data = PreparedData(prepare_data(request, tokenizer, out, num_workers=cfg.data.num_workers))
    else:
        data = ensure_prepared(request, tokenizer, root=cfg.data.cache_dir, num_workers=cfg.data.num_workers)
    report = data.report("train")
    check_report(report, cfg.data.max_bad_fraction, data.folder / "data_report.json")
    m = data.manifest
    disk = sum(f["bytes"] for f in m["files"].values())
    skipped = ", ".join(f"{n} {kind}" for kind, n in report.counts.items()) or "none"
    print(
        f"data: {m['n_documents']:,} documents, {m['n_tokens']:,} tokens; bad records skipped: {skipped} "
        f"(report: {data.folder / 'data_report.json'}); {m['splits']['train']['rows']:,} training and "
        f"{m['splits']['eval']['rows']:,} held-out rows of {cfg.data.seq_len} tokens; "
        f"{disk / 1e6:,.1f} MB on disk ({disk / max(1, m['n_tokens']):.2f} bytes/token)"
    )
    if args.out:
        print(f"train from it with --set data.prepared={data.folder}")
    return 0
