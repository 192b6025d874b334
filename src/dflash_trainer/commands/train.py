"""``dflash-train train``: wire config, target, data and trainer together for one run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config import RunConfig, write_resolved_config
from ..config.cli_args import add_config_args, resolve_config
from ..errors import UserError
from ..export.semantics import config_mismatches
from ..inference.regenerate import eos_ids
from ..io import atomic_write_json
from ..model.loading import load_target_config
from ..model.target import config_embedding_scale
from ..planner.preflight import preflight
from ..training import distributed
from ..training.checkpoint import read_counters
from ..training.distributed import check_launch, launched_world
from ..training.offline import run_layer_ids
from ..training.optim import resolve_epochs
from ..training.setup import prepare
from ..training.trackers import resolve_trackers
from ..training.trainer import RowStream, Trainer, build_drafter


def run_training(cfg: RunConfig, *, resume: str | None = None, progress: bool = True, overwrite: bool = False) -> dict:
    """One process (``topology.target_ranks`` 0), or this process's role in a torchrun launch."""
    out = Path(cfg.output_dir)
    # The launch must match the topology, on every rank, before anything is loaded.
    check_launch(cfg, launched_world())
    resolve_trackers(cfg.train.trackers)  # a named tracker that is not installed: one line, before loading
    # Plan this run before the target or the data are loaded: refuse what will not fit, and fill in the
    # loss chunk the planner derives (so run.yaml records it). topology.preflight=false overrides.
    cfg = preflight(cfg)
    if cfg.data.features:
        return run_offline(cfg, resume=resume, progress=progress, overwrite=overwrite)
    if cfg.topology.target_ranks:
        if int(os.environ.get("RANK", "0")) == cfg.topology.target_ranks:  # drafter rank 0 warns, once
            warn_unservable(cfg)
        return run_distributed(cfg, resume=resume, progress=progress, overwrite=overwrite)
    write_resolved_config(cfg, out)
    warn_unservable(cfg)
    target, tokenizer, train_rows, eval_rows, report = prepare(cfg)
    cfg = resolve_epochs(cfg, len(train_rows))
    _print_data(cfg, report, train_rows, eval_rows)
    trainer = Trainer(
        cfg, target, tokenizer, train_rows, eval_rows, out_dir=out, target_path=cfg.target.path, progress=progress
    )
    result = trainer.fit(resume=resume, overwrite=overwrite)
    return _finish(cfg, trainer, result)


def _print_data(cfg: RunConfig, report, train_rows, eval_rows) -> None:
    out = Path(cfg.output_dir)
    skipped = ", ".join(f"{n} {kind}" for kind, n in report.counts.items()) or "none"
    print(
        f"data: {report.n_documents} documents ({report.n_tokens:,} tokens, {report.n_loss_tokens:,} with loss); "
        f"bad records skipped: {skipped} (report: {out / 'data_report.json'}); {len(train_rows)} training rows and "
        f"{len(eval_rows)} held-out rows of {cfg.data.seq_len} tokens"
        + (
            f"; train.epochs {cfg.train.epochs:g} = {cfg.train.max_steps:,} steps of {cfg.train.grad_accum} rows"
            if cfg.train.epochs
            else ""
        ),
        flush=True,
    )


def _finish(cfg: RunConfig, trainer: Trainer, result: dict) -> dict:
    out = Path(cfg.output_dir)
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


def run_distributed(cfg: RunConfig, *, resume: str | None, progress: bool, overwrite: bool) -> dict:
    """This rank's part of a torchrun launch: target ranks produce and send, drafter ranks train."""
    import torch.distributed as dist

    layout, device, group = distributed.init(cfg)
    weights_group = distributed.weights_group(cfg, layout)  # on-policy: the drafter's weights to the target ranks
    writer = layout.rank == layout.target_ranks
    role = "target" if layout.is_target else "drafter"
    on_policy = cfg.train.stage == "on_policy"
    try:
        # a target rank drops the head, except in the on-policy stage: it verifies, and drafts
        keep = ("all" if on_policy else "body") if layout.is_target else "head"
        target, tokenizer, train_rows, eval_rows, report = prepare(
            cfg, keep=keep, share=distributed.on_rank0(cfg.data.prepare_timeout_s)
        )
        target.model.to(device)
        cfg = resolve_epochs(cfg, len(train_rows))  # every rank derives the same max_steps
        if writer:
            _print_data(cfg, report, train_rows, eval_rows)
        start = _agreed_start(cfg, resume, overwrite, train_rows, eval_rows, writer=writer, src=layout.target_ranks)
        print(
            f"rank {layout.rank} ({role}) of {layout.world}: {layout.target_ranks} target + "
            f"{layout.drafter_ranks} drafter ranks, starting at step {start['step']}",
            flush=True,
        )
        stream = RowStream(train_rows, cfg.train.seed)
        if layout.is_target:
            rollouts = None
            if on_policy:  # a drafter of the run's shape; its weights come from the drafter rank every step
                scratch = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_from": None})})
                drafter = build_drafter(scratch, target, tokenizer)
                rollouts = (drafter, eos_ids(target.model, tokenizer), weights_group)
            distributed.run_target_rank(
                cfg,
                layout,
                target,
                stream,
                len(train_rows),
                eval_rows,
                start_step=start["step"],
                rows_consumed=start["rows_consumed"],
                device=device,
                rollouts=rollouts,
            )
            dist.destroy_process_group()
            return {}
        feed = distributed.DrafterFeed(
            cfg,
            layout,
            stream,
            len(train_rows),
            eval_rows,
            device,
            start_step=start["step"],
            rows_consumed=start["rows_consumed"],
            weights_group=weights_group,
        )
        return _train_fed(cfg, target, tokenizer, train_rows, eval_rows, feed, group, start, progress=progress)
    except UserError as exc:
        raise UserError(f"rank {layout.rank} ({role}): {exc}") from None


def _agreed_start(cfg: RunConfig, resume, overwrite: bool, train_rows, eval_rows, *, writer: bool, src: int) -> dict:
    """``{"path", "step", "rows_consumed"}`` where the run starts: the writer (drafter rank 0) prepares
    the output folder and picks the checkpoint; under torchrun every rank learns it from rank ``src``,
    or the one-line error that stops all of them."""
    import torch.distributed as dist

    agreed = [None]
    if writer:
        try:
            path = Trainer.prepare_output(cfg, Path(cfg.output_dir), resume, overwrite, train_rows, eval_rows)
            counters = read_counters(path) if path is not None else {"step": 0, "rows_consumed": 0}
            agreed = [{"path": str(path) if path else None, **counters}]
        except UserError as exc:
            agreed = [{"error": str(exc)}]
    if dist.is_initialized():
        dist.broadcast_object_list(agreed, src=src)
    start = agreed[0]
    if "error" in start:
        raise UserError(start["error"])
    return start


def _train_fed(cfg: RunConfig, target, tokenizer, train_rows, eval_rows, feed, group, start: dict, *, progress: bool):
    """A drafter rank's training, its features from ``feed``; the summary on the writer, {} elsewhere."""
    import torch.distributed as dist

    trainer = Trainer(
        cfg,
        target,
        tokenizer,
        train_rows,
        eval_rows,
        out_dir=Path(cfg.output_dir),
        target_path=cfg.target.path,
        progress=progress,
        feed=feed,
        group=group,
    )
    if start["path"]:
        trainer.resume_from(Path(start["path"]))
    result = trainer.run()
    summary = _finish(cfg, trainer, result) if trainer.is_writer else {}
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def run_offline(cfg: RunConfig, *, resume: str | None, progress: bool, overwrite: bool) -> dict:
    """Train from the feature cache ``data.features``: one process, or ``topology.drafter_ranks``
    data-parallel processes under torchrun; the target's embedding and head are all that is loaded."""
    import torch

    from ..features.store import FeatureStore
    from ..features.window import Unreleased, WindowedStore, finish_window, open_window, released_shards
    from ..model.loading import load_target_head, target_identity
    from ..training.offline import CachedFeed, cache_mismatches

    out = Path(cfg.output_dir)
    world = launched_world()
    if world > 1:
        layout, device, group = distributed.init(cfg)
    else:
        layout, group = distributed.Layout(0, 1, 0), None
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    writer = layout.drafter_index == 0
    try:
        if cfg.data.feature_window:  # read while capture writes it: the plan now, each shard when it is done
            store = WindowedStore(cfg.data.features, cfg.data.feature_window, cfg.data.feature_window_timeout_s)
        else:
            store = FeatureStore(cfg.data.features)  # complete, sizes and checksums, before any weight is read
        target, tokenizer, _ = load_target_head(cfg.target, layer_ids=store.settings["layer_ids"])
        problems = cache_mismatches(cfg, store, target_identity(cfg.target, target), tokenizer)
        if problems:
            raise UserError(
                f"feature cache {cfg.data.features} does not match this run: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            )
        train_rows, eval_rows = store.rows("train"), store.rows("eval")
        cfg = resolve_epochs(cfg, len(train_rows))
        if cfg.data.feature_window:
            check_window(cfg, len(train_rows), store.rows_per_shard)
        if writer:
            write_resolved_config(cfg, out)
            warn_unservable(cfg)
            m = store.manifest
            size = (
                f"a window of {cfg.data.feature_window} shards of {store.rows_per_shard} rows"
                if cfg.data.feature_window
                else f"{m['bytes'] / 1e6:,.1f} MB"
            )
            print(
                f"data: feature cache {cfg.data.features} ({size}, {store.storage}): "
                f"{len(train_rows)} training and {len(eval_rows)} held-out rows of {cfg.data.seq_len} tokens; "
                "no target body loaded",
                flush=True,
            )
        checked = train_rows  # what the start checks may read: with a window, not the released shards
        if cfg.data.feature_window:
            checked = Unreleased(train_rows, released_shards(store.folder) * store.rows_per_shard)
        start = _agreed_start(cfg, resume, overwrite, checked, eval_rows, writer=writer, src=0)
        stream = RowStream(train_rows, cfg.train.seed, store.rows_per_shard if cfg.data.feature_window else None)
        dtype = getattr(torch, cfg.target.dtype)
        feed = CachedFeed(cfg, store, stream, layout, device, dtype, rows_consumed=start["rows_consumed"])
        if cfg.data.feature_window and writer:
            open_window(store.folder)  # a resumed or extended run: the capture goes on
        summary = _train_fed(cfg, target, tokenizer, train_rows, eval_rows, feed, group, start, progress=progress)
        if cfg.data.feature_window and writer:
            finish_window(store.folder)  # the capture stops instead of waiting for room
        return summary
    except UserError as exc:
        raise UserError(f"rank {layout.rank} (drafter): {exc}" if world > 1 else str(exc)) from None


def check_window(cfg: RunConfig, num_rows: int, rows_per_shard: int) -> None:
    """Refuse a window that cannot work, before training: shards are released at checkpoints, so the
    rows of ``train.save_every`` steps must fit in the window with the shard being read; without
    ``feature_window_keep`` the data is read once."""
    window, between = cfg.data.feature_window, cfg.train.save_every * cfg.train.grad_accum
    if (window - 1) * rows_per_shard < between:
        raise UserError(
            f"data.feature_window {window} holds {(window - 1) * rows_per_shard} rows besides the shard being read, "
            f"and the window moves at checkpoints, every train.save_every x grad_accum = {between} rows: raise "
            f"data.feature_window to at least {-(-between // rows_per_shard) + 1} or lower train.save_every"
        )
    if not cfg.data.feature_window_keep and cfg.train.max_steps * cfg.train.grad_accum > num_rows:
        raise UserError(
            f"train.max_steps x grad_accum = {cfg.train.max_steps * cfg.train.grad_accum} rows is more than one pass "
            f"over the cache's {num_rows} training rows, and data.feature_window deletes each shard once trained: "
            "set data.feature_window_keep=true, or fewer steps"
        )


def warn_unservable(cfg: RunConfig) -> list[str]:
    """Warn (stderr) about trained settings a format in ``export.formats`` cannot serve, before any
    weights are read: the export would refuse them later. Returns the warning lines."""
    if not cfg.export.formats:
        return []
    text_cfg, _, _ = load_target_config(cfg.target.path)
    n = text_cfg.num_hidden_layers
    ids = run_layer_ids(cfg, n)
    try:
        scale = config_embedding_scale(text_cfg)  # built on the meta device: no weights read
    except (ValueError, KeyError, TypeError, ImportError):  # a config transformers cannot build: unknown
        scale = None
    lines = [
        f"warning: not servable in the {fmt} format: {m.message} (export.formats names {fmt})"
        for fmt, found in config_mismatches(cfg, n, list(ids), scale).items()
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
    p.add_argument(
        "--stage",
        choices=("sft", "on-policy"),
        help="train.stage: sft (the default) or on-policy (the drafter's own rollouts; settings on_policy.*, "
        "start from a trained drafter with --set drafter.init_from=CKPT)",
    )
    p.set_defaults(func=_cmd_train)
    return p


def _cmd_train(args: argparse.Namespace) -> int:
    if args.stage is not None:  # the flag is train.stage, after every --set
        args.overrides = [*(args.overrides or []), f"train.stage={args.stage.replace('-', '_')}"]
    run_training(
        resolve_config(args),
        resume=None if args.resume == "none" else args.resume,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    return 0
