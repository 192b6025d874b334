"""Drafter checkpoints: weights (safetensors) plus everything needed to rebuild the drafter for a target.

    CHECKPOINT/drafter.safetensors   fc, hidden_norm, layers.*, norm (no embedding, no lm_head)
    CHECKPOINT/drafter_config.json   {"format", "spec": DrafterSpec fields, "target": {...}}

Loading checks the checkpoint against the target it is used with and names every mismatch
(hidden size, vocabulary, layer ids, feature count, block size) in one clear error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .drafter import DFlashDrafter, DrafterSpec
from .errors import UserError

WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"
FORMAT = "dflash-trainer-drafter/1"


def target_summary(target) -> dict:
    """What a drafter must agree with: ``target`` is a ``TargetModel``."""
    return {"num_layers": target.num_layers, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "layer_ids": list(target.layer_ids), "architectures": list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__])}


def save_drafter(drafter: DFlashDrafter, out_dir: Path, *, target, target_path: str | None = None,
                 extra: dict | None = None) -> Path:
    """Write a checkpoint folder atomically (temporary folder, then rename)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS))
    meta = {"format": FORMAT, "spec": dataclasses.asdict(drafter.spec),
            "target": {**target_summary(target), "path": target_path}, **(extra or {})}
    (tmp / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        import shutil

        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def read_checkpoint_config(path: Path) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise UserError(f"{path} is not a drafter checkpoint (expected {CONFIG} and {WEIGHTS})")
    meta = json.loads(cfg_file.read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"{cfg_file}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    return meta


def check_against_target(spec: DrafterSpec, layer_ids: list[int], target, where: str) -> None:
    """One error naming every mismatch between a drafter (spec, layer ids) and ``target``."""
    problems = []
    if spec.hidden_size != target.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} != target's {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} != target's {target.vocab_size}")
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"layer ids {bad} outside the target's 0..{target.num_layers - 1}")
    if len(layer_ids) != spec.num_features:
        problems.append(f"{len(layer_ids)} layer ids for {spec.num_features} feature layers")
    if list(layer_ids) != list(target.layer_ids):
        problems.append(f"layer ids {list(layer_ids)} != the target's hooked ids {list(target.layer_ids)}")
    if spec.block_size < 2:
        problems.append(f"block size {spec.block_size} < 2")
    if not 0 <= spec.mask_token_id < target.vocab_size:
        problems.append(f"mask token id {spec.mask_token_id} outside the target vocabulary")
    if problems:
        raise UserError(f"{where} does not match the target: " + "; ".join(problems))


def load_drafter(path: Path, target, dtype: torch.dtype = torch.float32) -> tuple[DFlashDrafter, dict]:
    """``(drafter in eval mode, checkpoint metadata)`` for ``target`` (a ``TargetModel``)."""
    meta = read_checkpoint_config(path)
    spec = DrafterSpec(**{**meta["spec"], "sliding_window_layers": tuple(meta["spec"]["sliding_window_layers"])})
    check_against_target(spec, meta["target"]["layer_ids"], target, f"checkpoint {path}")
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
    drafter.load_state_dict(load_file(str(Path(path) / WEIGHTS)))
    return drafter.to(dtype).eval(), meta
