"""Everything a run needs before its first step: the target, the tokenizer, and packed rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import RunConfig
from ..data.documents import check_report
from ..data.prepare import find_storage, request_for
from ..data.records import expand_paths
from ..data.storage import PreparedData
from ..errors import UserError
from ..model.loading import load_target_config, load_target_model


def open_prepared_data(
    cfg: RunConfig, tokenizer, vocab_size: int, *, share: Callable | None = None, progress=True, report_dir=None
) -> PreparedData:
    """A run's prepared storage (found, or prepared on first use). ``share(find)``: a distributed launch's
    way to let one rank prepare while the others wait (``distributed.on_rank0``); it returns the storage
    folder on every rank. The reports are copied into ``report_dir`` (default ``output_dir``) and
    checked against ``data.max_bad_fraction`` there."""
    request = request_for(cfg.data, tokenizer, vocab_size, min_tokens=cfg.drafter.block_span + 1)

    def find() -> str:
        return str(find_storage(cfg.data, request, tokenizer, progress=progress))

    data = PreparedData(share(find) if share is not None else find())
    out = Path(report_dir or cfg.output_dir)
    check_report(data.report("train"), cfg.data.max_bad_fraction, out / "data_report.json")
    if data.settings["holdout"] == "files":
        check_report(data.report("eval"), cfg.data.max_bad_fraction, out / "eval_data_report.json")
    return data


def open_training_data(cfg: RunConfig, tokenizer, vocab_size: int, *, share: Callable | None = None, progress=True):
    """``(train rows, eval rows, train report)`` of a run (``open_prepared_data``)."""
    data = open_prepared_data(cfg, tokenizer, vocab_size, share=share, progress=progress)
    report = data.report("train")
    eval_rows = data.rows("eval")
    if not eval_rows:
        raise UserError("no held-out documents: set data.eval_files or give more than one training document")
    return data.rows("train"), eval_rows, report


def prepare(cfg: RunConfig, keep: str = "all", share: Callable | None = None):
    """``(target, tokenizer, train_rows, eval_rows, data report)`` for a run; data problems are reported,
    not raised deep. ``keep``: "all" (one process), "body" (a target rank: no head) or "head" (a drafter
    rank: the frozen embedding and head, no decoder layers). The data are ready (tokenized, checked)
    before the target's weights are read: a data problem costs no model load."""
    if not cfg.data.train_files and not cfg.data.prepared:
        raise UserError(
            "data.train_files is empty: pass --set data.train_files=[path/to/data.jsonl] "
            "(or --set data.prepared=DIR, a folder written by dflash-train prepare-data)"
        )
    expand_paths(cfg.data.train_files + cfg.data.eval_files)  # a typo or a FIFO fails in a second
    config, tokenizer, _ = load_target_config(cfg.target.path)
    train_rows, eval_rows, report = open_training_data(cfg, tokenizer, config.vocab_size, share=share)
    target, tokenizer = load_target_model(cfg.target)
    if keep != "all":
        target.keep_only(keep)
    return target, tokenizer, train_rows, eval_rows, report
