"""The main job on the embedded tiny target, end to end, with no network and no input.

1. resolve and record the run's config;
2. build chat prompts from held-out standard-library files (files the tiny target never trained on);
3. regenerate the responses with the target (DFlash drafters learn the target's own outputs);
4. train a drafter on most of them, holding out every 8th record;
5. report teacher-forced tau on the held-out records before and after training, where the
   checkpoint is, and how to export it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..config import RunConfig, write_resolved_config
from ..config.cli_args import add_config_args, resolve_config
from ..data.records import iter_records
from ..inference.regenerate import eos_ids, regenerate_records
from ..inference.sampled_acceptance import chain_tau_both_ways
from ..io import atomic_write_json, atomic_write_text
from ..model.loading import load_target, resolve_target_path
from ..precision import preferred_train_dtype
from ..tiny_target.corpus import load_split
from ..training.setup import prepare
from ..training.trainer import Trainer
from ..variants import variant_of

EVAL_EVERY_NTH_RECORD = 8


def build_prompts(prompts_per_file: int, lines_per_prompt: int = 8) -> list[dict]:
    """Chat records asking the target to continue a held-out module from evenly spaced cut points."""
    records = []
    for f in load_split("held_out"):
        lines = f.text.splitlines(keepends=True)
        if len(lines) < 2 * lines_per_prompt:
            continue
        step = max(1, (len(lines) - lines_per_prompt) // prompts_per_file)
        for start in range(0, len(lines) - lines_per_prompt, step)[:prompts_per_file]:
            head = "".join(lines[start : start + lines_per_prompt])
            records.append(
                {
                    "id": f"{f.relpath}:{start + 1}",
                    "messages": [
                        {"role": "user", "content": f"Continue the Python module `{f.relpath}`:\n{head}"},
                        {"role": "assistant", "content": ""},
                    ],
                }
            )
    return records


def _write_jsonl(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def run_demo(cfg: RunConfig, *, max_new_tokens: int = 160, prompts_per_file: int = 4) -> dict:
    t_start = time.time()
    resolve_target_path(cfg.target.path)  # fail on a bad target before anything is written
    out = Path(cfg.output_dir)
    write_resolved_config(cfg, out)
    print(f"[1/5] config resolved and written to {out / 'run.yaml'}", flush=True)

    prompts = build_prompts(prompts_per_file)
    _write_jsonl(out / "prompts.jsonl", prompts)
    model, tokenizer, folder = load_target(cfg.target)
    print(f"[2/5] {len(prompts)} prompts from held-out stdlib files; target {folder}", flush=True)

    t0 = time.time()
    records = list(iter_records([str(out / "prompts.jsonl")]))
    generated = list(regenerate_records(records, model, tokenizer, max_new_tokens=max_new_tokens, batch_size=16))
    generated = [r for r in generated if r["messages"][-1]["content"].strip()]
    train_records = [r for i, r in enumerate(generated) if i % EVAL_EVERY_NTH_RECORD]
    eval_records = [r for i, r in enumerate(generated) if not i % EVAL_EVERY_NTH_RECORD]
    _write_jsonl(out / "train.jsonl", train_records)
    _write_jsonl(out / "eval.jsonl", eval_records)
    print(
        f"[3/5] regenerated {len(generated)} responses with the target in {time.time() - t0:.0f}s: "
        f"{len(train_records)} for training, {len(eval_records)} held out",
        flush=True,
    )

    cfg = cfg.model_copy(
        update={
            "data": cfg.data.model_copy(
                update={"train_files": [str(out / "train.jsonl")], "eval_files": [str(out / "eval.jsonl")]}
            )
        }
    )
    write_resolved_config(cfg, out)
    target, tokenizer, train_rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tokenizer, train_rows, eval_rows, out_dir=out, target_path=cfg.target.path)
    before = trainer.evaluate()
    n_params = sum(p.numel() for p in trainer.drafter.parameters())
    print(
        f"[4/5] training a {n_params / 1e6:.2f}M-parameter drafter ({cfg.drafter.num_layers} layers, block "
        f"{cfg.drafter.block_size}) on {len(train_rows)} rows of {cfg.data.seq_len} tokens for "
        f"{cfg.train.max_steps} steps; untrained tau {before['tau']:.3f}",
        flush=True,
    )
    t0 = time.time()
    after = trainer.fit(overwrite=True)  # the demo always starts over
    checkpoint = out / "checkpoints" / f"step-{trainer.c.step:07d}"
    print(
        f"[5/5] trained in {time.time() - t0:.0f}s. Teacher-forced tau on {after['blocks']} held-out blocks: "
        f"{before['tau']:.3f} before -> {after['tau']:.3f} after training",
        flush=True,
    )
    print("      acceptance per slot after training: " + " ".join(f"{a:.2f}" for a in after["slot_acceptance"]))
    # served with sampling, drafts are accepted when the target's sample equals them: tau at T = 1
    sampled = chain_tau_both_ways(
        target, trainer.drafter, eval_rows[: cfg.data.max_eval_rows], eos_ids(model, tokenizer), temperature=1.0
    )
    print(
        f"      chain tau at T=0 (greedy): {after['tau']:.3f}; at T=1 (speculative sampling): "
        f"{sampled['expected']:.3f} expected, {sampled['measured']:.3f} +- {sampled['measured_stderr']:.3f} "
        f"measured over {sampled['rounds']} rounds",
        flush=True,
    )
    spec = trainer.drafter.spec  # a variant with heads z-lab's layout lacks (DSpark) exports as speculators
    fmt = "zlab" if variant_of(spec).export_refusal("zlab", spec) is None else "speculators"
    print(
        f"checkpoint: {checkpoint}\n"
        f"export it for serving:  dflash-train export --format {fmt} {checkpoint} {out / f'export-{fmt}'}\n"
        f"total time {time.time() - t_start:.0f}s",
        flush=True,
    )
    summary = {
        "tau_before": before,
        "tau_after": after,
        "tau_t1": sampled,
        "checkpoint": str(checkpoint),
        "records": {"train": len(train_records), "eval": len(eval_records)},
        "seconds": round(time.time() - t_start, 1),
        "torch_threads": torch.get_num_threads(),
    }
    atomic_write_json(out / "demo.json", summary)
    return summary


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="train a drafter on the embedded tiny target end to end (no input needed)")
    add_config_args(p, default_preset="tiny-demo")
    p.add_argument("--max-new-tokens", type=int, default=160, help="length of each regenerated response")
    p.add_argument("--prompts-per-file", type=int, default=4, help="prompts cut from each held-out stdlib file")
    p.set_defaults(func=_cmd_demo)
    return p


def _cmd_demo(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if not any(o.split("=", 1)[0].strip() == "train.dtype" for o in args.overrides):
        # The precision this CPU does well: bf16 autocast (fp32 master weights) where it has bf16 GEMMs.
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"dtype": preferred_train_dtype("cpu")})})
        why = "this CPU has bf16 GEMMs" if cfg.train.dtype == "bfloat16" else "this CPU has no native bf16 GEMMs"
    else:
        why = "as set"
    print(f"precision: train.dtype={cfg.train.dtype} ({why}; --set train.dtype=float32|bfloat16 to choose)")
    run_demo(cfg, max_new_tokens=args.max_new_tokens, prompts_per_file=args.prompts_per_file)
    return 0
