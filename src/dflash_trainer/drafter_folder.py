"""The drafter's folder format, the one owner: what eval, speculate, export and training all read.

    FOLDER/drafter.safetensors   fc, hidden_norm, layers.*, norm (no embedding, no lm_head)
    FOLDER/drafter_config.json   {"format", "spec": DrafterSpec fields, "target": {...}, "step"?}

A drafter-only folder (``save_drafter``) is written into one temporary folder and renamed into place
(``io.atomic_folder``); a training checkpoint (``training/checkpoint.py``) is this folder plus the
state a bit-identical resume needs. Loading checks the drafter against the target it is used with
and names every mismatch in one error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import JsonRecord, UserError, check_schema
from .io import atomic_folder
from .model.drafter import DFlashDrafter, DrafterSpec
from .model.target import head_logit_options
from .variants import make_drafter

WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"
FORMAT = "dflash-trainer-drafter/1"


def target_summary(target) -> dict:
    """What a drafter must agree with: ``target`` is a ``TargetModel``."""
    return {
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "layer_ids": list(target.layer_ids),
        "architectures": list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__]),
    }


def write_drafter_files(folder: Path, drafter: DFlashDrafter, meta: dict) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def drafter_meta(drafter: DFlashDrafter, target, target_path: str | None, extra: dict | None) -> dict:
    return {
        "format": FORMAT,
        "spec": drafter.spec.to_dict(),
        "target": {**target_summary(target), "path": target_path},
        **(extra or {}),
    }


def save_drafter(
    drafter: DFlashDrafter, out_dir: Path, *, target, target_path: str | None = None, extra: dict | None = None
) -> Path:
    """Write a drafter-only checkpoint folder atomically."""
    with atomic_folder(Path(out_dir)) as tmp:
        write_drafter_files(tmp, drafter, drafter_meta(drafter, target, target_path, extra))
    return Path(out_dir)


class _Target(JsonRecord):
    layer_ids: list[int]
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    path: str | None = None


class _Meta(JsonRecord):
    """``drafter_config.json``'s fields, typed (the spec is checked by ``DrafterSpec.from_dict``)."""

    spec: dict
    target: _Target
    step: int | None = None


def read_checkpoint_config(path: Path) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise UserError(f"{path} is not a drafter checkpoint (expected {CONFIG} and {WEIGHTS})")
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{cfg_file} is unreadable or corrupt ({exc}): use another checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{cfg_file}: unknown checkpoint format {got!r} (expected {FORMAT})")
    check_schema(_Meta, meta, str(cfg_file), "the checkpoint is damaged: use another one")
    try:
        DrafterSpec.from_dict(meta["spec"])
    except UserError as exc:
        raise UserError(f"{cfg_file}: {exc}; use another checkpoint") from None
    return meta


def checkpoint_spec(meta: dict, target_config=None) -> DrafterSpec:
    """The ``DrafterSpec`` of a checkpoint's metadata; a checkpoint written before the spec carried the
    head's logit options takes them from ``target_config``."""
    spec = dict(meta["spec"])
    if "logit_scale" not in spec and target_config is not None:
        options = head_logit_options(target_config)
        spec.update(logit_scale=options["logit_scale"], logit_softcap=options["softcap"])
    return DrafterSpec.from_dict(spec)


def _mismatches(spec: DrafterSpec, layer_ids: list[int], hidden: int, vocab: int, num_layers: int) -> list[str]:
    problems = []
    if spec.hidden_size != hidden:
        problems.append(f"hidden size {spec.hidden_size} != target's {hidden}")
    if spec.vocab_size != vocab:
        problems.append(f"vocabulary {spec.vocab_size} != target's {vocab}")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        problems.append(f"layer ids {bad} outside the target's 0..{num_layers - 1}")
    if len(layer_ids) != spec.num_features:
        problems.append(f"{len(layer_ids)} layer ids for {spec.num_features} feature layers")
    if spec.block_size < 2:
        problems.append(f"block size {spec.block_size} < 2")
    if not 0 <= spec.mask_token_id < vocab:
        problems.append(f"mask token id {spec.mask_token_id} outside the target vocabulary")
    return problems


def check_against_target(spec: DrafterSpec, layer_ids: list[int], target, where: str) -> None:
    """One error naming every mismatch between a drafter (spec, layer ids) and a loaded ``TargetModel``,
    whose hooked layers must be exactly ``layer_ids``."""
    problems = _mismatches(spec, layer_ids, target.hidden_size, target.vocab_size, target.num_layers)
    if list(layer_ids) != list(target.layer_ids):
        problems.append(f"layer ids {list(layer_ids)} != the target's hooked ids {list(target.layer_ids)}")
    if problems:
        raise UserError(f"{where} does not match the target: " + "; ".join(problems))


def check_against_config(spec: DrafterSpec, layer_ids: list[int], config, where: str) -> None:
    """The same check against a target's (text) config, before its weights are loaded."""
    problems = _mismatches(spec, layer_ids, config.hidden_size, config.vocab_size, config.num_hidden_layers)
    if problems:
        raise UserError(f"{where} does not match the target: " + "; ".join(problems))


def load_drafter(path: Path, target, dtype: torch.dtype = torch.float32) -> tuple[DFlashDrafter, dict]:
    """``(drafter in eval mode, checkpoint metadata)`` for ``target`` (a ``TargetModel``)."""
    meta = read_checkpoint_config(path)
    spec = checkpoint_spec(meta, target.config)
    check_against_target(spec, meta["target"]["layer_ids"], target, f"checkpoint {path}")
    drafter = make_drafter(spec, target.embed_tokens, target.lm_head_weight)
    weights = Path(path) / WEIGHTS
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise UserError(
            f"checkpoint weights {weights} cannot be read ({exc}): the checkpoint is damaged; use another one "
            "(dflash-train train resumes from the last good one)"
        ) from None
    try:
        drafter.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"checkpoint weights {weights} do not fit the drafter its config describes ({first})") from None
    return drafter.to(dtype).eval(), meta
