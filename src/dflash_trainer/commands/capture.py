"""``dflash-train capture``: run the target over the packed rows once and store the features training needs.

dflash-train capture --config my-run.yaml --out FEATURES_DIR         # one process
torchrun --nproc-per-node 4 --no-python dflash-train capture ...      # 4 target processes, one shard set
dflash-train capture --verify FEATURES_DIR                            # every shard's sha256
dflash-train capture --engine vllm ...                                # the target in vLLM (any size)
dflash-train capture --print-server-command --out FEATURES_DIR ...    # a vLLM server to capture from, then
dflash-train capture --server http://HOST:8000 --out FEATURES_DIR ... # (repeat --server for several)
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
    p.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default=None,
        help="what runs the target (capture.engine): transformers here, or vLLM (DFLASH_VLLM_PYTHON's)",
    )
    p.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="URL",
        help="a running vLLM server started with --print-server-command's line (repeat for several); implies --engine vllm",
    )
    p.add_argument(
        "--print-server-command",
        action="store_true",
        help="print the vLLM server command line a --server capture needs (for this config and --out), and exit",
    )
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


def engine_args(cfg) -> dict:
    """``vllm.LLM`` / ``vllm serve`` arguments of this config's capture."""
    v = cfg.capture.vllm
    args = {
        "dtype": cfg.target.dtype,
        "max_model_len": v.max_model_len or cfg.data.seq_len + 1,  # a row-long document and the one token sampled
        "tensor_parallel_size": v.tensor_parallel_size,
        "pipeline_parallel_size": v.pipeline_parallel_size,
    }
    if v.quantization:
        args["quantization"] = v.quantization
    return {**args, **v.engine_args}


def vllm_layer_ids(cfg) -> list[int]:
    """vLLM's hidden_states indices to extract for this config, from the target's config alone."""
    from ..features.vllm_features import extraction_ids
    from ..model.loading import load_target_config
    from ..model.target import check_layer_ids
    from ..training.offline import run_layer_ids

    config, _, _ = load_target_config(cfg.target.path)
    n = config.num_hidden_layers
    return extraction_ids(check_layer_ids(run_layer_ids(cfg, n), n), n)


def vllm_producer(cfg, target, out: Path):
    """``VllmFeatures`` from the servers of ``capture.vllm.servers``, or from one ``vllm.LLM`` started here."""
    from ..features.capture import VLLM_STATES
    from ..features.vllm_features import VllmFeatures, extraction_ids
    from ..model.loading import resolve_target_path
    from ..serving.hidden_states import ServerExtractor, VllmExtractor

    states = out / VLLM_STATES
    states.mkdir(parents=True, exist_ok=True)
    hf_ids = extraction_ids(list(target.layer_ids), target.num_layers)
    if cfg.capture.vllm.servers:
        extractor = ServerExtractor(cfg.capture.vllm.servers)
    else:
        print(f"capture: starting vLLM on {resolve_target_path(cfg.target.path)} (extracting hidden states {hf_ids})")
        extractor = VllmExtractor(resolve_target_path(cfg.target.path), hf_ids, states, engine_args(cfg))
    return VllmFeatures(extractor, target)


def run_capture(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from ..features.capture import InProcessFeatures, capture_shards, check_out_folder, start_capture
    from ..features.store import shard_plan, write_manifest
    from ..features.window import window_state
    from ..model.loading import load_target_config, load_target_head, load_target_model, target_identity
    from ..training.distributed import launched_world, on_rank0
    from ..training.setup import open_prepared_data

    progress = not args.no_progress
    if args.verify:
        if args.out or args.config or args.overrides or args.overwrite:
            raise UserError("--verify DIR takes no other option")
        return _verify(args.verify, progress)
    if not args.out:
        raise UserError("--out DIR is required: the folder the feature cache is written to")
    out = Path(args.out)
    cfg = resolve_config(args)
    if args.server:
        cfg.capture.vllm.servers = list(args.server)
    if args.engine:
        cfg.capture.engine = args.engine
    if cfg.capture.vllm.servers:  # servers are vLLM's, whatever else says
        cfg.capture.engine = "vllm"
    if args.print_server_command:
        from ..features.capture import VLLM_STATES
        from ..model.loading import resolve_target_path
        from ..serving.hidden_states import server_command

        hf_ids = vllm_layer_ids(cfg)
        folder = (out / VLLM_STATES).resolve()
        print(server_command(resolve_target_path(cfg.target.path), hf_ids, folder, engine_args(cfg)))
        return 0
    if cfg.data.features and Path(cfg.data.features).resolve() != out.resolve():
        raise UserError("data.features is set: capture writes a cache (--out), it does not read one")
    if not cfg.data.train_files and not cfg.data.prepared:
        raise UserError(
            "data.train_files is empty: pass --set data.train_files=[path/to/data.jsonl] (or data.prepared)"
        )
    check_out_folder(out, args.overwrite)
    if cfg.capture.engine == "vllm" and not cfg.capture.vllm.servers:
        from ..serving.launch import vllm_python

        vllm_python()  # named before any work when there is none
    world = launched_world()
    if world > 1 and cfg.capture.engine == "vllm":
        raise UserError(
            "capture --engine vllm runs in one process: vLLM shards the target itself "
            "(capture.vllm.tensor_parallel_size), and several servers are several --server URLs"
        )
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
        if cfg.capture.engine == "vllm":  # the head and the final norm here, the body in vLLM
            target, _, _ = load_target_head(cfg.target, final_norm=True)
            producer = vllm_producer(cfg, target, out)
        else:
            target, _ = load_target_model(cfg.target)
            if device is not None:
                target.model.to(device)
            producer = InProcessFeatures(target)
        plan = capture_folder_plan(cfg, target, data, target_identity(cfg.target, target))
        if share is not None:
            share(lambda: start_capture(out, plan, overwrite=args.overwrite))
        else:
            start_capture(out, plan, overwrite=args.overwrite)
        rows = {"train": data.rows("train"), "eval": data.rows("eval")}
        shards = shard_plan(plan["splits"], plan["rows_per_shard"])
        try:
            stats = capture_shards(
                producer,
                rows,
                out,
                plan,
                shards[rank::world],
                window=cfg.data.feature_window,
                window_timeout_s=cfg.data.feature_window_timeout_s,
                progress=progress and rank == 0,
            )
        finally:
            producer.close()
        if world > 1:
            dist.barrier()
        if rank == 0:
            s = max(stats["seconds"], 1e-9)
            tokens = sum(plan["splits"].values()) * cfg.data.seq_len
            print(
                f"capture: {stats['rows']:,} rows ({stats['tokens']:,} tokens) in {stats['seconds']:.2f} s on this "
                f"process: {stats['rows'] / s:.2f} rows/s, {stats['tokens'] / s:,.0f} tokens/s, "
                f"{stats['bytes'] / s / 1e6:,.1f} MB/s written"
            )
            if cfg.data.feature_window and window_state(out)["finished"]:
                print(f"{out}: a window read by a training run that has finished; no manifest (not every row captured)")
                return 0
            manifest = write_manifest(out, plan)
            print(
                f"{out}: {len(manifest['shards'])} shards, {manifest['bytes'] / 1e6:,.1f} MB "
                f"({manifest['bytes'] / max(1, tokens):,.1f} bytes/token, {plan['settings']['storage_dtype']}); "
                f"train from it with --set data.features={out}"
            )
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    return 0
