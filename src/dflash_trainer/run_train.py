"""`dflash-train train`: wire config, target, data and trainer together for one run."""

from __future__ import annotations

import json
from pathlib import Path

from .config import RunConfig, write_resolved_config
from .data.documents import load_documents
from .data.packing import pack_documents
from .errors import UserError
from .target import TargetModel
from .target_loading import load_target
from .train import Trainer


def prepare(cfg: RunConfig):
    """``(target, tokenizer, train_rows, eval_rows)`` for a run; data problems are reported, not raised deep."""
    if not cfg.data.train_files:
        raise UserError("data.train_files is empty: pass --set data.train_files=[path/to/data.jsonl]")
    model, tokenizer, _ = load_target(cfg.target)
    target = TargetModel(model, layer_ids=cfg.target.layer_ids, num_feature_layers=cfg.target.num_feature_layers)
    out = Path(cfg.output_dir)
    common = dict(vocab_size=target.vocab_size, min_tokens=cfg.drafter.block_size + 1,
                  max_bad_fraction=cfg.data.max_bad_fraction)
    docs, report = load_documents(cfg.data.train_files, tokenizer, report_path=out / "data_report.json", **common)
    if cfg.data.eval_files:
        eval_docs, _ = load_documents(cfg.data.eval_files, tokenizer, report_path=out / "eval_data_report.json", **common)
    else:
        n_eval = max(1, int(len(docs) * cfg.data.eval_fraction)) if len(docs) > 1 else 0
        docs, eval_docs = docs[: len(docs) - n_eval], docs[len(docs) - n_eval:]
        if not eval_docs:
            raise UserError("no held-out documents: set data.eval_files or give more than one training document")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows = pack_documents(docs, cfg.data.seq_len, pad)
    eval_rows = pack_documents(eval_docs, cfg.data.seq_len, pad)
    return target, tokenizer, train_rows, eval_rows, report


def run_training(cfg: RunConfig, *, resume: str | None = None, progress: bool = True, overwrite: bool = False) -> dict:
    out = Path(cfg.output_dir)
    # Plan this run before the target or the data are loaded: refuse what will not fit, and fill in the
    # loss chunk the planner derives (so run.yaml records it). topology.preflight=false overrides.
    from .planner.preflight import preflight

    cfg = preflight(cfg)
    write_resolved_config(cfg, out)
    target, tokenizer, train_rows, eval_rows, report = prepare(cfg)
    skipped = ", ".join(f"{n} {kind}" for kind, n in report.counts.items()) or "none"
    print(f"data: {report.n_documents} documents ({report.n_tokens:,} tokens, {report.n_loss_tokens:,} with loss); "
          f"bad records skipped: {skipped} (report: {out / 'data_report.json'}); {len(train_rows)} training rows and "
          f"{len(eval_rows)} held-out rows of {cfg.data.seq_len} tokens", flush=True)
    trainer = Trainer(cfg, target, tokenizer, train_rows, eval_rows, out_dir=out, target_path=cfg.target.path,
                      progress=progress)
    result = trainer.fit(resume=resume, overwrite=overwrite)
    final = out / "checkpoints" / f"step-{trainer.c.step:07d}"
    summary = {"steps": trainer.c.step, "eval": result, "checkpoint": str(final),
               "skipped_nonfinite": trainer.c.skipped_nonfinite, "rows_without_anchors": trainer.c.rows_without_anchors}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done: tau {result.get('tau', float('nan')):.3f} on held-out rows; checkpoint {final}", flush=True)
    return summary
