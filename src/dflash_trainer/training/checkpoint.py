"""Checkpoints, the one owner: drafter weights, metadata, trainer state, checksums, verification, resume.

    CHECKPOINT/drafter.safetensors   fc, hidden_norm, layers.*, norm (no embedding, no lm_head)
    CHECKPOINT/drafter_config.json   {"format", "spec": DrafterSpec fields, "target": {...}, "step"?}
    CHECKPOINT/trainer_state.pt      optimizer, scheduler, RNG states, counters (training checkpoints)
    CHECKPOINT/run.yaml              the resolved config of the run that wrote it (training checkpoints)
    CHECKPOINT/checksums.json        sha256 of every other file (training checkpoints)

A drafter-only checkpoint (``save_drafter``) is what eval, speculate and export read; a training
checkpoint (``save_training_checkpoint``) adds what a bit-identical resume needs. Both are written
into one temporary folder and renamed into place (``io.atomic_folder``). Loading checks the
checkpoint against the target it is used with and names every mismatch in one error.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import RunConfig, dump_config
from ..errors import JsonRecord, UserError, check_schema
from ..io import atomic_folder, sha256_file
from ..model.drafter import DFlashDrafter, DrafterSpec
from ..model.target import head_logit_options
from ..variants import make_drafter

WEIGHTS = "drafter.safetensors"
CONFIG = "drafter_config.json"
STATE_FILE = "trainer_state.pt"
CHECKSUMS = "checksums.json"
RUN_YAML = "run.yaml"
REQUIRED = (WEIGHTS, CONFIG, STATE_FILE, RUN_YAML)  # what checksums.json must list
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


def _write_drafter_files(folder: Path, drafter: DFlashDrafter, meta: dict) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _drafter_meta(drafter: DFlashDrafter, target, target_path: str | None, extra: dict | None) -> dict:
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
        _write_drafter_files(tmp, drafter, _drafter_meta(drafter, target, target_path, extra))
    return Path(out_dir)


def save_training_checkpoint(
    final: Path,
    drafter: DFlashDrafter,
    trainer_state: dict,
    cfg: RunConfig,
    *,
    target,
    target_path: str | None,
    step: int,
) -> Path:
    """``final`` = drafter files + trainer state + run.yaml + checksums.json, all or nothing.

    Non-finite weights are refused before anything is written; a write that fails (a full disk) leaves
    no folder behind and the earlier checkpoints intact, and is a ``UserError``."""
    check_finite_weights(drafter, f"checkpoint {final}")
    try:
        with atomic_folder(Path(final)) as tmp:
            _write_drafter_files(tmp, drafter, _drafter_meta(drafter, target, target_path, {"step": step}))
            torch.save(trainer_state, tmp / STATE_FILE)
            (tmp / RUN_YAML).write_text(dump_config(cfg), encoding="utf-8")
            sums = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
            (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=2) + "\n", encoding="utf-8")
    except (OSError, RuntimeError, SafetensorError) as exc:  # torch.save reports a full disk as RuntimeError
        reason = getattr(exc, "strerror", None) or f"the write was cut short ({_first_line(exc)})"
        try:
            free = f"; {shutil.disk_usage(Path(final).parent).free / 1e6:.1f} MB free on its disk"
        except OSError:
            free = ""
        raise UserError(
            f"cannot write checkpoint {final}: {reason}{free}; the earlier checkpoints are intact, "
            "free space and continue with --resume auto"
        ) from None
    return Path(final)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def verify_checkpoint(path: Path) -> str | None:
    """None if the training checkpoint folder is complete and every checksum matches, else the reason."""
    sums_file = Path(path) / CHECKSUMS
    if not sums_file.is_file():
        return "no checksums.json (incomplete write)"
    try:
        sums = json.loads(sums_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return "checksums.json is not valid JSON"
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        return "checksums.json is not a mapping of file names to sha256 digests"
    unlisted = [name for name in REQUIRED if name not in sums]
    if unlisted:
        return f"checksums.json does not list {', '.join(unlisted)}"
    for name, digest in sums.items():
        f = Path(path) / name
        if "/" in name or not f.is_file():
            return f"{name} is missing"
        if sha256_file(f) != digest:
            return f"{name} does not match its checksum"
    try:
        bad = _non_finite_tensors(load_file(str(Path(path) / WEIGHTS)))
    except (SafetensorError, OSError) as exc:
        return f"{WEIGHTS} cannot be read: {_first_line(exc)}"
    if bad:
        return f"{WEIGHTS} holds non-finite weights ({bad[0]})"
    return None


def _newest_valid(out_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """``(newest checkpoint under out_dir/checkpoints that verifies or None, [(newer corrupt one, why)])``."""
    root = Path(out_dir) / "checkpoints"
    problems: list[tuple[Path, str]] = []
    if root.is_dir():
        for path in sorted((p for p in root.iterdir() if p.name.startswith("step-")), reverse=True):
            problem = verify_checkpoint(path)
            if problem is None:
                return path, problems
            problems.append((path, problem))
    return None, problems


def find_resume_checkpoint(out_dir: Path) -> Path | None:
    """Newest checkpoint under ``out_dir/checkpoints`` that verifies; corrupted ones are skipped with a warning."""
    found, problems = _newest_valid(out_dir)
    for path, problem in problems:
        print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return found


def load_training_state(path: Path, drafter: DFlashDrafter) -> dict:
    """Load the drafter weights of a training checkpoint into ``drafter``; returns its trainer state."""
    try:
        drafter.load_state_dict(load_file(str(Path(path) / WEIGHTS)))
        return torch.load(Path(path) / STATE_FILE, weights_only=False)
    except (RuntimeError, SafetensorError, OSError, EOFError) as exc:
        raise UserError(f"checkpoint {path} cannot be loaded into this run's drafter: {_first_line(exc)}") from None


# Settings a resume may change: they do not change what a step computes (when to log, evaluate or save,
# where the planner thinks the run lives, how the loss is chunked or attention is laid out). Any other
# change (block size, data, seed, lr, schedule length, ...) would silently mix two runs in one.
RESUME_MAY_CHANGE = (
    "name",
    "output_dir",
    "train.log_every",
    "train.eval_every",
    "train.save_every",
    "train.max_consecutive_nonfinite",
    "data.max_eval_rows",
    "data.max_bad_fraction",
    "data.max_record_bytes",
    "data.prepared",  # where the same rows are read from (a storage that differs is refused)
    "data.cache_dir",
    "data.num_workers",
    "data.prepare_timeout_s",
    "loss.chunk_size",
    "drafter.attention_backend",
    "drafter.activation_checkpointing",
    "topology.",
)


def _non_finite_tensors(state: dict) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def check_finite_weights(drafter: DFlashDrafter, where: str) -> None:
    """``UserError`` naming the first non-finite drafter tensors: such weights must never become a
    checkpoint (their checksums would match, and ``--resume auto`` would pick them)."""
    bad = _non_finite_tensors(drafter.state_dict())
    if bad:
        raise UserError(
            f"{where}: drafter weights are not finite ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
            "nothing was written. Resume from the last checkpoint with --resume auto and a lower train.lr"
        )


def remove_dead_writes(out_dir: Path) -> list[Path]:
    """Remove the temporary folders (``checkpoints/.step-*``) left by a checkpoint write that was killed
    or ran out of disk; returns what was removed. Only the run that owns ``out_dir`` calls this."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    dead = [p for p in root.iterdir() if p.name.startswith(".step-") and p.is_dir() and not p.is_symlink()]
    for p in dead:
        shutil.rmtree(p, ignore_errors=True)
    return dead


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(path: Path, cfg: RunConfig) -> list[str]:
    """``"key: old -> new"`` for every setting of ``cfg`` that differs from the checkpoint's run.yaml and
    changes what a step computes (everything but ``RESUME_MAY_CHANGE``). Settings only one side knows
    (a newer or older dflash-trainer) are not compared."""
    try:
        old = _flat(yaml.safe_load((Path(path) / RUN_YAML).read_text(encoding="utf-8")) or {})
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as exc:
        raise UserError(f"checkpoint {path}: cannot read its {RUN_YAML}: {exc}") from None
    new = _flat(cfg.model_dump(mode="json"))
    return [
        f"{key}: {old[key]!r} -> {new[key]!r}"
        for key in new
        if key in old
        and old[key] != new[key]
        and not any(key == s or (s.endswith(".") and key.startswith(s)) for s in RESUME_MAY_CHANGE)
    ]


def resume_checkpoint(out_dir: Path, resume: str | None, overwrite: bool) -> Path | None:
    """The checkpoint a run continues from: ``resume`` is None (a fresh run), "auto" or a path.

    "auto" takes the newest that verifies (a warning names each newer corrupt one); with no checkpoint
    yet it starts fresh (None); where checkpoints exist but none verifies it is refused, naming each
    one's problem in the one error line, unless ``overwrite`` (start over: None). A named path that
    does not exist or does not verify is refused."""
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        if not path.is_dir():
            raise UserError(f"checkpoint {resume} does not exist (or is not a folder)")
        problem = verify_checkpoint(path)
        if problem:
            raise UserError(f"checkpoint {path} cannot be resumed: {problem}")
        return path
    found, problems = _newest_valid(out_dir)
    if found is None and problems:
        if overwrite:
            return None
        raise UserError(
            f"every checkpoint in {Path(out_dir) / 'checkpoints'} is corrupt ("
            + "; ".join(f"{path.name}: {why}" for path, why in problems)
            + "); start over with --overwrite, or resume a copy you trust with --resume PATH"
        )
    for path, problem in problems:
        print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return found


def read_counters(path: Path) -> dict:
    """``{"step", "rows_consumed"}`` of a training checkpoint: where a resumed run continues."""
    counters = torch.load(Path(path) / STATE_FILE, weights_only=False).get("counters", {})
    if "rows_consumed" not in counters:
        raise UserError(
            f"checkpoint {path} was written by an older dflash-trainer (its data position is not a "
            "global row index) and cannot be resumed; its drafter still loads for eval and export"
        )
    return {"step": counters["step"], "rows_consumed": counters["rows_consumed"]}


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
