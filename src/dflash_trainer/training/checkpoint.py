"""Training checkpoints, the one owner: trainer state, run config, checksums, verification, resume.

    CHECKPOINT/drafter.safetensors   fc, hidden_norm, layers.*, norm (no embedding, no lm_head)
    CHECKPOINT/drafter_config.json   {"format", "spec": DrafterSpec fields, "target": {...}, "step"?}
    CHECKPOINT/trainer_state.pt      optimizer, scheduler, RNG states, counters (training checkpoints)
    CHECKPOINT/run.yaml              the resolved config of the run that wrote it (training checkpoints)
    CHECKPOINT/checksums.json        sha256 of every other file (training checkpoints)

A training checkpoint is a drafter folder (``drafter_folder.py``: what eval, speculate and export
read) plus what a bit-identical resume needs, written into one temporary folder and renamed into
place (``io.atomic_folder``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..config import RunConfig, dump_config
from ..drafter_folder import CONFIG, WEIGHTS, drafter_meta, write_drafter_files
from ..errors import UserError
from ..io import atomic_folder, sha256_file
from ..model.drafter import DFlashDrafter

STATE_FILE = "trainer_state.pt"
CHECKSUMS = "checksums.json"
RUN_YAML = "run.yaml"
REQUIRED = (WEIGHTS, CONFIG, STATE_FILE, RUN_YAML)  # what checksums.json must list


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
            write_drafter_files(tmp, drafter, drafter_meta(drafter, target, target_path, {"step": step}))
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
    "train.trackers",
    "train.tracker_project",
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
        # none of a checkpoint's own files (a run's folder has run.yaml too): no torn write, no checkpoint
        own = (CHECKSUMS, WEIGHTS, CONFIG, STATE_FILE)
        if not any((path / name).exists() for name in own):
            hint = (
                " (a run's folder: its checkpoints are under checkpoints/)" if (path / "checkpoints").is_dir() else ""
            )
            raise UserError(
                f"--resume {path} is not a training checkpoint: none of {', '.join(own)}{hint}; "
                "name a checkpoints/step-N folder, or --resume auto"
            )
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
