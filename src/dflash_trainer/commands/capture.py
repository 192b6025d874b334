"""``dflash-train capture``: run the target over the packed rows once and store the features training needs.

dflash-train capture --config my-run.yaml --out FEATURES_DIR         # one process
torchrun --nproc-per-node 4 --no-python dflash-train capture ...      # 4 target processes, one shard set
dflash-train capture --verify FEATURES_DIR                            # every shard's sha256
dflash-train train --config my-run.yaml --set data.features=FEATURES_DIR   # then: no target body

Run the same command again after an interruption: the shards already written are kept and the
capture continues with the others (with any number of processes).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

from ..config.cli_args import add_config_args, resolve_config
from ..errors import UserError


def add_capture_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dflash-train capture`` on the CLI's sub-parsers (``func`` is set)."""
    p = subparsers.add_parser(
        "capture", help="run the target once over the data and store its features (train --set data.features=DIR)"
    )
    add_config_args(p, default_preset=None)
    p.add_argument("--out", default=None, metavar="DIR", help="the feature cache folder to write (or continue)")
    p.add_argument("--verify", default=None, metavar="DIR", help="check every shard of a feature cache and exit")
    p.add_argument("--overwrite", action="store_true", help="start over in a folder that holds another capture")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_capture)
    return p


def _verify(folder: str, progress: bool) -> int:
    from tqdm import tqdm

    from ..features.store import FeatureStore

    store = FeatureStore(folder, check_shards=False)  # complete; then every shard, each problem named
    m = store.manifest
    with tqdm(total=m["bytes"], desc="verify", unit="B", unit_scale=True, disable=not progress) as bar:
        problems = store.verify(progress=bar.update)
    if problems:
        raise UserError(f"{len(problems)} bad shard(s) in {folder}: {problems[0]}")
    print(
        f"{folder}: ok, {len(m['shards'])} shards verified ({m['bytes'] / 1e6:,.1f} MB); {m['splits']['train']:,} "
        f"training and {m['splits']['eval']:,} held-out rows of {m['settings']['seq_len']} tokens, "
        f"{m['settings']['storage_dtype']}, target layers {m['settings']['layer_ids']}"
    )
    return 0


def capture_folder_plan(cfg, target, data, identity: dict) -> dict:
    """The ``capture.json`` of this config's capture (``features.capture.capture_plan``)."""
    from ..features.capture import capture_plan
    from ..training.step import needs_teacher

    n_eval = len(data.rows("eval"))
    return capture_plan(
        storage=cfg.capture.dtype or cfg.target.dtype,
        teacher=cfg.capture.teacher if cfg.capture.teacher is not None else needs_teacher(cfg),
        layer_ids=list(target.layer_ids),
        seq_len=cfg.data.seq_len,
        hidden_size=target.hidden_size,
        target=identity,
        data={
            "settings": data.settings,
            "inputs": data.manifest["inputs"],
            "files": {name: f["sha256"] for name, f in data.manifest["files"].items()},
            "eval_rows_total": n_eval,
        },
        splits={"train": len(data.rows("train")), "eval": min(cfg.data.max_eval_rows, n_eval)},
        shard_bytes=cfg.capture.shard_bytes,
    )


def run_capture(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from ..features.capture import capture_shards, check_out_folder, start_capture
    from ..features.store import shard_plan, write_manifest
    from ..model.loading import load_target_config, load_target_model, target_identity
    from ..training.distributed import launched_world, on_rank0
    from ..training.setup import open_prepared_data

    progress = not args.no_progress
    if args.verify:
        if args.out or args.config or args.overrides or args.overwrite:
            raise UserError("--verify DIR takes no other option")
        return _verify(args.verify, progress)
    if not args.out:
        raise UserError("--out DIR is required: the folder the feature cache is written to")
    cfg = resolve_config(args)
    if cfg.data.features:
        raise UserError("data.features is set: capture writes a cache (--out), it does not read one")
    if not cfg.data.train_files and not cfg.data.prepared:
        raise UserError(
            "data.train_files is empty: pass --set data.train_files=[path/to/data.jsonl] (or data.prepared)"
        )
    out = Path(args.out)
    check_out_folder(out, args.overwrite)
    world = launched_world()
    share, rank = None, 0
    if world > 1:
        dist.init_process_group(backend="gloo", timeout=timedelta(seconds=cfg.capture.timeout_s))
        rank = dist.get_rank()
        share = on_rank0(cfg.data.prepare_timeout_s)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    try:
        config, tokenizer, _ = load_target_config(cfg.target.path)
        out.mkdir(parents=True, exist_ok=True)
        data = open_prepared_data(
            cfg, tokenizer, config.vocab_size, share=share, progress=progress and rank == 0, report_dir=out
        )
        target, _ = load_target_model(cfg.target)
        if device is not None:
            target.model.to(device)
        plan = capture_folder_plan(cfg, target, data, target_identity(cfg.target, target))
        if share is not None:
            share(lambda: start_capture(out, plan, overwrite=args.overwrite))
        else:
            start_capture(out, plan, overwrite=args.overwrite)
        rows = {"train": data.rows("train"), "eval": data.rows("eval")}
        shards = shard_plan(plan["splits"], plan["rows_per_shard"])
        stats = capture_shards(target, rows, out, plan, shards[rank::world], progress=progress and rank == 0)
        if world > 1:
            dist.barrier()
        if rank == 0:
            manifest = write_manifest(out, plan)
            s = max(stats["seconds"], 1e-9)
            tokens = sum(plan["splits"].values()) * cfg.data.seq_len
            print(
                f"capture: {stats['rows']:,} rows ({stats['tokens']:,} tokens) in {stats['seconds']:.1f} s on this "
                f"process: {stats['rows'] / s:.2f} rows/s, {stats['tokens'] / s:,.0f} tokens/s, "
                f"{stats['bytes'] / s / 1e6:,.1f} MB/s written"
            )
            print(
                f"{out}: {len(manifest['shards'])} shards, {manifest['bytes'] / 1e6:,.1f} MB "
                f"({manifest['bytes'] / max(1, tokens):,.1f} bytes/token, {plan['settings']['storage_dtype']}); "
                f"train from it with --set data.features={out}"
            )
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0
