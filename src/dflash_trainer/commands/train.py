"""``dflash-train train``: wire config, target, data and trainer together for one run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import RunConfig, write_resolved_config
from ..config.cli_args import add_config_args, resolve_config
from ..export.semantics import config_mismatches
from ..io import atomic_write_json
from ..model.loading import load_target_config
from ..model.target import default_layer_ids
from ..planner.preflight import preflight
from ..training.setup import prepare
from ..training.trainer import Trainer


def run_training(cfg: RunConfig, *, resume: str | None = None, progress: bool = True, overwrite: bool = False) -> dict:
    out = Path(cfg.output_dir)
    # Plan this run before the target or the data are loaded: refuse what will not fit, and fill in the
    # loss chunk the planner derives (so run.yaml records it). topology.preflight=false overrides.
    cfg = preflight(cfg)
    write_resolved_config(cfg, out)
    warn_unservable(cfg)
    target, tokenizer, train_rows, eval_rows, report = prepare(cfg)
    skipped = ", ".join(f"{n} {kind}" for kind, n in report.counts.items()) or "none"
    print(
        f"data: {report.n_documents} documents ({report.n_tokens:,} tokens, {report.n_loss_tokens:,} with loss); "
        f"bad records skipped: {skipped} (report: {out / 'data_report.json'}); {len(train_rows)} training rows and "
        f"{len(eval_rows)} held-out rows of {cfg.data.seq_len} tokens",
        flush=True,
    )
    trainer = Trainer(
        cfg, target, tokenizer, train_rows, eval_rows, out_dir=out, target_path=cfg.target.path, progress=progress
    )
    result = trainer.fit(resume=resume, overwrite=overwrite)
    final = out / "checkpoints" / f"step-{trainer.c.step:07d}"
    summary = {
        "steps": trainer.c.step,
        "eval": result,
        "checkpoint": str(final),
        "skipped_nonfinite": trainer.c.skipped_nonfinite,
        "rows_without_anchors": trainer.c.rows_without_anchors,
    }
    atomic_write_json(out / "summary.json", summary)
    print(f"done: tau {result.get('tau', float('nan')):.3f} on held-out rows; checkpoint {final}", flush=True)
    return summary


def warn_unservable(cfg: RunConfig) -> list[str]:
    """Warn (stderr) about trained settings a format in ``export.formats`` cannot serve, before any
    weights are read: the export would refuse them later. Returns the warning lines."""
    if not cfg.export.formats:
        return []
    text_cfg, _, _ = load_target_config(cfg.target.path)
    n = text_cfg.num_hidden_layers
    ids = (
        cfg.target.layer_ids
        if cfg.target.layer_ids is not None
        else default_layer_ids(n, cfg.target.num_feature_layers)
    )
    lines = [
        f"warning: not servable in the {fmt} format: {m.message} (export.formats names {fmt})"
        for fmt, found in config_mismatches(cfg, n, list(ids)).items()
        for m in found
    ]
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return lines


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train a drafter (data.train_files: JSONL chat or pre-tokenized records)")
    add_config_args(p, default_preset=None)
    p.add_argument(
        "--resume",
        default="none",
        metavar="auto|PATH|none",
        help="auto: continue from the newest complete checkpoint in output_dir",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs still go to metrics.jsonl)")
    p.add_argument("--overwrite", action="store_true", help="start over in an output_dir that holds checkpoints")
    p.set_defaults(func=_cmd_train)
    return p


def _cmd_train(args: argparse.Namespace) -> int:
    run_training(
        resolve_config(args),
        resume=None if args.resume == "none" else args.resume,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    return 0
