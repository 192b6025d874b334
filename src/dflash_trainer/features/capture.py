"""Run the target over packed rows once and write what training needs into the feature cache.

    plan = capture_plan(...)                  settings, identities, splits, rows per shard
    start_capture(folder, plan)               capture.json written, or checked against a restart's
    capture_shards(producer, rows, folder, plan, shards)   this process's shards, resumable
    write_manifest(folder, plan)              (store.py) once every shard is done

The shard list (``store.shard_plan``) does not depend on how many processes capture: process k of n
writes shards k, k+n, ... and skips those already done, so a restarted capture (with any number of
processes) continues where the killed one stopped: nothing is written twice, nothing is lost.

The producer computes the features of a shard's rows: ``InProcessFeatures`` (the target in this
process, row by row) or ``vllm_features.VllmFeatures`` (vLLM, all of a shard's documents at once).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from ..data.packing import PackedRow
from ..io import atomic_write_json
from ..model.target import TargetFeatures, TargetModel
from .store import FORMAT, VERSION, CacheError, done_shards, read_plan, remove_partial_writes, row_bytes, write_shard
from .window import TrainingFinished, wait_for_room


def capture_plan(
    *,
    storage: str,
    teacher: bool,
    layer_ids: list[int],
    seq_len: int,
    hidden_size: int,
    target: dict,
    data: dict,
    splits: dict[str, int],
    shard_bytes: int,
) -> dict:
    """The ``capture.json`` of a capture: everything its shards depend on, and their layout."""
    k = len(layer_ids)
    sizes = {
        "train": row_bytes(seq_len, hidden_size, k, storage, teacher),
        "eval": row_bytes(seq_len, hidden_size, k, storage, True),
    }
    plan = {
        "format": FORMAT,
        "version": VERSION,
        "settings": {
            "storage_dtype": storage,
            "teacher": teacher,
            "layer_ids": list(layer_ids),
            "seq_len": seq_len,
            "hidden_size": hidden_size,
        },
        "target": target,
        "data": data,
        "splits": splits,
        "row_bytes": sizes,
        "rows_per_shard": max(1, shard_bytes // max(sizes.values())),
    }
    # the cache's identity in one hash: what its bytes depend on (settings, target, data rows, layout)
    identity = {k: plan[k] for k in ("settings", "target", "splits", "rows_per_shard")}
    identity["target"] = {k: v for k, v in target.items() if k != "path"}
    identity["data"] = data.get("files")
    plan["key"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return plan


def plan_differences(have: dict, want: dict) -> list[str]:
    """What differs between two capture plans, in words (empty: the same capture)."""
    out = []
    for key in ("settings", "target", "splits", "rows_per_shard"):
        if have.get(key) != want.get(key):
            a, b = have.get(key), want.get(key)
            if isinstance(a, dict) and isinstance(b, dict):
                diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                out.append(f"{key} ({'; '.join(diff)})")
            else:
                out.append(f"{key}: {a!r} -> {b!r}")
    if have.get("data", {}).get("files") != want.get("data", {}).get("files"):
        out.append("the prepared data (other rows)")
    return out


REPORTS = ("data_report.json", "eval_data_report.json")  # the data's bad-record reports, copied beside the cache
VLLM_STATES = "vllm-states"  # capture --engine vllm: the files vLLM writes, each removed once read


def check_out_folder(folder: Path, overwrite: bool = False) -> None:
    """Refuse an ``--out`` that exists and holds something other than a feature cache (before any work)."""
    folder = Path(folder)
    if overwrite or not folder.is_dir() or (folder / "capture.json").is_file():
        return
    if any(p.name not in (*REPORTS, VLLM_STATES) for p in folder.iterdir()):
        raise CacheError(f"--out {folder} exists and is not a feature cache: choose an empty or new folder")


def start_capture(folder: Path, plan: dict, *, overwrite: bool = False, log=print) -> None:
    """Write ``capture.json`` into a new or empty ``folder``, or continue the capture it holds when that
    capture had the same plan (else one line naming the first difference)."""
    folder = Path(folder)
    check_out_folder(folder, overwrite)
    old = read_plan(folder) if folder.is_dir() else None
    if old is not None and not overwrite:
        problems = plan_differences(old, plan)
        if problems:
            raise CacheError(
                f"{folder} holds a capture with other settings: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; use another --out, or --overwrite to start it over"
            )
        for tmp in remove_partial_writes(folder):
            log(f"removed {tmp}: a shard write that did not finish")
        return
    if overwrite and folder.is_dir():
        for p in [*(folder / "shards").glob("*"), folder / "manifest.json", folder / "capture.json"]:
            if p.is_file():
                p.unlink()
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "capture.json", plan)


class InProcessFeatures:
    """Features of packed rows from the target in this process, one row at a time."""

    def __init__(self, target: TargetModel):
        self.target = target

    def features_of(self, rows: Sequence[PackedRow], need_teacher: bool) -> Iterator[TargetFeatures]:
        """Lazily, row by row (the progress bar moves per row)."""
        dev = self.target.device
        for r in rows:
            with torch.no_grad():
                yield self.target.features(r.input_ids.to(dev), r.position_ids.to(dev), need_teacher=need_teacher)

    def close(self) -> None:
        pass


def capture_shards(
    producer,
    rows: dict[str, Sequence],
    folder: Path,
    plan: dict,
    shards: list[tuple[str, int, int, int]],
    *,
    window: int | None = None,
    window_timeout_s: float = 3600.0,
    progress: bool = True,
    log=print,
) -> dict:
    """Capture ``shards`` (``store.shard_plan`` entries) of ``rows`` (split -> packed rows) that are not
    done yet, with ``producer`` (``InProcessFeatures`` or ``vllm_features.VllmFeatures``). Returns
    ``{"rows", "tokens", "bytes", "seconds", "skipped_shards"}`` of this call. ``window``: training reads
    the cache as it is written (``window.py``): held-out shards first, and training shard s only once
    it fits the window."""
    from .store import shard_name

    folder = Path(folder)
    storage, teacher = plan["settings"]["storage_dtype"], plan["settings"]["teacher"]
    done = done_shards(folder)
    todo = [s for s in shards if shard_name(s[0], s[1]) not in done]
    if window:
        todo.sort(key=lambda s: s[0] != "eval")  # training evaluates on them while the window is full
    total_rows = sum(end - start for _, _, start, end in todo)
    stats = {"rows": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "skipped_shards": len(shards) - len(todo)}
    if stats["skipped_shards"]:
        log(f"capture: {stats['skipped_shards']} of {len(shards)} shards already written, continuing")
    bar = tqdm(total=total_rows, desc="capture", unit="row", disable=not progress, mininterval=2)
    t0, waited = time.monotonic(), False
    try:
        for split, index, start, end in todo:
            if window and split == "train":
                try:
                    if wait_for_room(folder, index, window, window_timeout_s) and not waited:
                        log(
                            f"capture: the window of {window} shards filled up; writing each shard as training frees one"
                        )
                        waited = True
                except TrainingFinished as finished:
                    log(
                        f"capture: training finished (after {finished.args[0]} shards); shards {index} and on are "
                        "not needed and were not captured"
                    )
                    break
            need_teacher = teacher or split == "eval"  # held-out rows are scored against the teacher
            out = {}
            batch = [rows[split][r] for r in range(start, end)]
            for r, row, feats in zip(range(start, end), batch, producer.features_of(batch, need_teacher)):
                out[r] = {
                    "input_ids": row.input_ids,
                    "position_ids": row.position_ids,
                    "loss_mask": row.loss_mask,
                    "context": feats.context,
                    "last_hidden": feats.last_hidden if need_teacher else None,
                }
                stats["rows"] += 1
                stats["tokens"] += row.input_ids.numel()
                bar.update(1)
            record = write_shard(folder, shard_name(split, index), out, storage)
            stats["bytes"] += record["bytes"]
            elapsed = max(time.monotonic() - t0, 1e-9)
            bar.set_postfix(
                tok_s=f"{stats['tokens'] / elapsed:,.0f}", MB_s=f"{stats['bytes'] / elapsed / 1e6:,.1f}", refresh=False
            )
    finally:
        bar.close()
    stats["seconds"] = time.monotonic() - t0
    return stats
