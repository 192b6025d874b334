"""Everything a run needs before its first step: the target, the tokenizer, and packed rows."""

from __future__ import annotations

from pathlib import Path

from ..config import RunConfig
from ..data.documents import load_documents
from ..data.packing import pack_documents
from ..data.records import expand_paths
from ..errors import UserError
from ..model.loading import load_target_model


def prepare(cfg: RunConfig, keep: str = "all"):
    """``(target, tokenizer, train_rows, eval_rows, data report)`` for a run; data problems are reported,
    not raised deep. ``keep``: "all" (one process), "body" (a target rank: no head) or "head" (a drafter
    rank: the frozen embedding and head, no decoder layers)."""
    if not cfg.data.train_files:
        raise UserError("data.train_files is empty: pass --set data.train_files=[path/to/data.jsonl]")
    # Data paths are checked before the target is read: a typo or a FIFO costs no model load.
    expand_paths(cfg.data.train_files + cfg.data.eval_files)
    target, tokenizer = load_target_model(cfg.target)
    if keep != "all":
        target.keep_only(keep)
    out = Path(cfg.output_dir)
    common = dict(
        vocab_size=target.vocab_size,
        min_tokens=cfg.drafter.block_size + 1,
        max_bad_fraction=cfg.data.max_bad_fraction,
        max_record_bytes=cfg.data.max_record_bytes,
    )
    docs, report = load_documents(cfg.data.train_files, tokenizer, report_path=out / "data_report.json", **common)
    if cfg.data.eval_files:
        eval_docs, _ = load_documents(
            cfg.data.eval_files, tokenizer, report_path=out / "eval_data_report.json", **common
        )
    else:
        n_eval = max(1, int(len(docs) * cfg.data.eval_fraction)) if len(docs) > 1 else 0
        docs, eval_docs = docs[: len(docs) - n_eval], docs[len(docs) - n_eval :]
        if not eval_docs:
            raise UserError("no held-out documents: set data.eval_files or give more than one training document")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_rows = pack_documents(docs, cfg.data.seq_len, pad)
    eval_rows = pack_documents(eval_docs, cfg.data.seq_len, pad)
    return target, tokenizer, train_rows, eval_rows, report
