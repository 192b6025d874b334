"""A feature cache read as a bounded window while ``capture`` writes it (``data.feature_window = N``).

Capture and training run at the same time on the same folder. The training shards are read in shard
order (rows shuffled within each shard, ``training.trainer.shard_window_order``), so the training
position ``g`` of the first pass is in shard ``g // rows_per_shard``, and the disk holds a sliding
window of shards:

    capture   writes training shard s only when s < released + N (waits otherwise), held-out shards first
    training  waits for the shard it needs (its completion record), reads it
    training  at each checkpoint: shards wholly before the checkpoint's position are released: their
              files deleted (unless data.feature_window_keep), their records marked, ``window.json`` written

A shard is released only once a checkpoint is past it, so a run stopped and resumed from its newest
checkpoint re-reads nothing that is gone and skips nothing: the rows after the checkpoint are in
shards still on disk. A released shard keeps its record (``"released": true``), so a restarted
capture does not write it again. At most N training shards (and the held-out ones) are on disk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from ..io import atomic_write_json
from .store import CacheError, FeatureStore, _read_json, read_plan, shard_name

WINDOW = "window.json"  # {"released": k, "finished": bool}: shards 0..k-1 released; training ended
POLL_S = 0.2


class TrainingFinished(Exception):
    """Training ended (its last step) before the capture: the rest of the rows are not needed."""


def window_state(folder: Path) -> dict:
    """``{"released": k, "finished": bool}`` (nothing released, not finished, before training wrote it)."""
    try:
        state = json.loads((Path(folder) / WINDOW).read_text())
        return {"released": int(state["released"]), "finished": bool(state.get("finished", False))}
    except FileNotFoundError:
        return {"released": 0, "finished": False}
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheError(f"{Path(folder) / WINDOW} is damaged ({exc}): the window position is lost") from None


def released_shards(folder: Path) -> int:
    """How many training shards training has released (0 before it released any)."""
    return window_state(folder)["released"]


def finish_window(folder: Path, finished: bool = True) -> None:
    """Training ended: a capture waiting for room stops (``TrainingFinished``)."""
    atomic_write_json(Path(folder) / WINDOW, {**window_state(folder), "finished": finished})


def open_window(folder: Path) -> None:
    """Training (re)starts: a finished mark of an earlier run is cleared."""
    if window_state(folder)["finished"]:
        finish_window(folder, finished=False)


def release_shards(folder: Path, upto: int, keep: bool) -> None:
    """Release training shards ``[released, upto)``: delete their files and mark their records (unless
    ``keep``), then advance ``window.json``."""
    folder, start = Path(folder), released_shards(folder)
    for i in range(start, upto) if not keep else ():
        name = shard_name("train", i)
        record_path = folder / "shards" / f"{name}.json"
        record = _read_json(record_path, "capture again")
        (folder / "shards" / f"{name}.safetensors").unlink(missing_ok=True)
        record["released"] = True
        atomic_write_json(record_path, record)
    if upto > start:
        atomic_write_json(folder / WINDOW, {"released": upto, "finished": False})


def _wait_until(ready, timeout_s: float, error: str) -> bool:
    """Poll ``ready()`` every ``POLL_S`` until it is true (``CacheError(error)`` after ``timeout_s``);
    returns whether it had to wait."""
    deadline, waited = time.monotonic() + timeout_s, False
    while not ready():
        if time.monotonic() > deadline:
            raise CacheError(error)
        waited = True
        time.sleep(POLL_S)
    return waited


def wait_for_room(folder: Path, index: int, window: int, timeout_s: float) -> bool:
    """Capture side: return once training shard ``index`` fits the window (``index < released + window``);
    ``TrainingFinished`` when training ended first. Returns whether it waited."""

    def fits() -> bool:
        state = window_state(folder)
        if state["finished"]:
            raise TrainingFinished(state["released"])
        return index < state["released"] + window

    return _wait_until(
        fits,
        timeout_s,
        f"capture waited {timeout_s:g} s for training to release shard {index - window} of {folder}: is "
        "`dflash-train train` running with data.features on this folder? (data.feature_window_timeout_s)",
    )


def wait_for_plan(folder: Path, timeout_s: float) -> None:
    """Training side: return once ``capture.json`` exists (the capture may start after training)."""
    _wait_until(
        lambda: read_plan(folder) is not None,
        timeout_s,
        f"no capture in {folder} after {timeout_s:g} s: start `dflash-train capture --out {folder}` with "
        "this config (data.feature_window_timeout_s)",
    )


class WindowedStore(FeatureStore):
    """A feature cache read while it is written: the plan instead of the manifest, and a shard that is
    not written yet waited for (``timeout_s``)."""

    def __init__(self, folder, window: int, timeout_s: float):
        self.folder, self.window, self.timeout_s = Path(folder), window, timeout_s
        self.folder.mkdir(parents=True, exist_ok=True)
        wait_for_plan(self.folder, timeout_s)
        plan = read_plan(self.folder)
        self.manifest = {**plan, "shards": {}, "bytes": 0}  # the plan: the shards are not all written yet
        self.rows_per_shard = plan["rows_per_shard"]
        self.storage = plan["settings"]["storage_dtype"]
        self._open = {}

    def shard_of(self, split: str, index: int):
        name = shard_name(split, index // self.rows_per_shard)
        if name not in self._open:
            self._wait(name)
            if len(self._open) > 2 * self.window:  # let go of released shards' handles
                for old in [n for n in self._open if n.startswith("train-")][: self.window]:
                    del self._open[old]
        return super().shard_of(split, index)

    def _wait(self, name: str) -> None:
        record_path = self.folder / "shards" / f"{name}.json"
        _wait_until(
            record_path.is_file,
            self.timeout_s,
            f"training waited {self.timeout_s:g} s for feature shard {name} of {self.folder}: is `dflash-train "
            "capture` running on this folder, with this config? (data.feature_window_timeout_s)",
        )
        record = _read_json(record_path, "capture again")
        if record.get("released"):
            raise CacheError(
                f"feature shard {name} of {self.folder} was released by training (its rows were trained): resume "
                "from the newest checkpoint, or set data.feature_window_keep=true to train on them again"
            )


class Unreleased(Sequence):
    """The training rows of a windowed cache that are not released yet (lazily: a row is read, and its
    shard waited for, only when asked for): what a check before training may look at."""

    def __init__(self, rows: Sequence, start: int):
        self.rows, self.start = rows, start

    def __len__(self) -> int:
        return max(0, len(self.rows) - self.start)

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.rows[self.start + index]
