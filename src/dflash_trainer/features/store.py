"""The feature cache on disk: what ``capture`` wrote, as ``train --set data.features=DIR`` reads it.

A cache folder holds the target's features of every packed row of a prepared data set, addressed by
the same row index (row ``r`` of split ``s`` here is row ``r`` of split ``s`` of the prepared data):

    capture.json                 the plan, written first: settings, target and data identity, splits,
                                 rows per shard (a restarted capture must find the same plan)
    shards/{split}-{i:05d}.safetensors   rows [i*R, (i+1)*R) of the split (R = rows_per_shard)
    shards/{split}-{i:05d}.json          the shard's completion record: rows, bytes, sha256, mtime
    manifest.json                the plan plus every shard's record, written when all are complete

Tensors of row ``r`` in its shard (L = seq_len, k = hooked layers, H = hidden size):

    {r}.input_ids     int32 [L]            {r}.position_ids  int32 [L]      {r}.loss_mask  uint8 [L]
    {r}.context       [L, k*H]  hooked layers' outputs, concatenated in layer-id order
    {r}.last_hidden   [L, H]    the final-normed last hidden state (when the teacher is stored;
                                always for held-out rows, which the evaluation scores against it)
    {r}.context.scale, {r}.last_hidden.scale   float32 [L]   FP8 storage only (``codec.py``)

A shard is written under a temporary name and renamed, then its record is written: a shard without a
record is not done, so a killed capture redoes at most the shards it was writing. Opening a cache
checks every shard's size against its record and, when its size or modification time differs from
what was recorded, its sha256 (``verify`` checks every shard's sha256).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..data.packing import PackedRow
from ..errors import JsonRecord, UserError, check_schema
from ..io import atomic_write, atomic_write_json, sha256_file
from ..model.target import TargetFeatures
from .codec import STORAGE_DTYPES, decode, element_bytes, encode, scale_bytes

FORMAT = "dflash-trainer feature cache"
VERSION = 1
SPLITS = ("train", "eval")
ROW_INT_BYTES = 4 + 4 + 1  # input_ids int32, position_ids int32, loss_mask uint8, per token


class CacheError(UserError):
    """A feature cache that cannot be used as it is; the message names the file and what to do."""


# capture.json and manifest.json, typed: what the readers use, checked in one place (strict JSON types,
# extra keys kept), so a hand-edited or damaged field is one line naming it, not an AttributeError.


class _Settings(JsonRecord):
    storage_dtype: Literal[tuple(STORAGE_DTYPES)]  # type: ignore[valid-type]
    teacher: bool
    layer_ids: list[int]
    seq_len: int = Field(gt=0)
    hidden_size: int = Field(gt=0)


class _Plan(JsonRecord):
    settings: _Settings
    target: dict
    data: dict
    splits: dict[Literal["train", "eval"], int]
    row_bytes: dict[str, int]
    rows_per_shard: int = Field(gt=0)
    key: str


class _ShardRecord(JsonRecord):
    rows: list[int]
    bytes: int = Field(ge=0)
    sha256: str
    stamp: list[int] = Field(min_length=2, max_length=2)


class _Manifest(_Plan):
    shards: dict[str, _ShardRecord]
    bytes: int = Field(ge=0)


def row_bytes(seq_len: int, hidden: int, num_features: int, storage: str, teacher: bool) -> int:
    """Bytes one row of ``seq_len`` tokens takes in a shard (tensor data; headers add ~100 bytes per tensor)."""
    widths = [num_features * hidden] + ([hidden] if teacher else [])
    per_token = ROW_INT_BYTES + sum(w * element_bytes(storage) + scale_bytes(storage) for w in widths)
    return seq_len * per_token


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


def shard_plan(splits: dict[str, int], rows_per_shard: int) -> list[tuple[str, int, int, int]]:
    """``[(split, shard index, first row, end row)]`` of every shard, train first: the same whatever the
    number of capturing processes (rank k of n writes the shards at positions k, k+n, ... of this list)."""
    out = []
    for split in SPLITS:
        n = splits.get(split, 0)
        for i, start in enumerate(range(0, n, rows_per_shard)):
            out.append((split, i, start, min(n, start + rows_per_shard)))
    return out


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CacheError(f"{path} is unreadable or corrupt ({exc}); {what}") from None
    if not isinstance(value, dict):
        raise CacheError(f"{path} is not a JSON object; {what}")
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


# -- writing ------------------------------------------------------------------------------------


def done_shards(folder: Path) -> dict[str, dict]:
    """Shard name -> completion record, for every shard whose file exists with the recorded size, or
    that training released (``window.py``: trained, checkpointed, its file deleted)."""
    out = {}
    for record_path in sorted((folder / "shards").glob("*.json")):
        try:
            record = _read_json(record_path, "")
        except (CacheError, FileNotFoundError):
            continue  # a torn record: the shard is redone
        shard = record_path.with_suffix(".safetensors")
        if record.get("released") is True or (shard.is_file() and shard.stat().st_size == record.get("bytes")):
            out[record_path.stem] = record
    return out


def write_shard(folder: Path, name: str, rows: dict[int, dict], storage: str) -> dict:
    """Write shard ``name`` of ``rows`` (row index -> ``{"input_ids", "position_ids", "loss_mask",
    "context", "last_hidden"?}`` tensors, features ``[L, D]`` in any float dtype) and its record."""
    tensors: dict[str, torch.Tensor] = {}
    for r, row in rows.items():
        tensors[f"{r}.input_ids"] = row["input_ids"].to("cpu", torch.int32).contiguous()
        tensors[f"{r}.position_ids"] = row["position_ids"].to("cpu", torch.int32).contiguous()
        tensors[f"{r}.loss_mask"] = row["loss_mask"].to("cpu", torch.uint8).contiguous()
        for key in ("context", "last_hidden"):
            if row.get(key) is not None:
                for part, t in encode(row[key], storage).items():
                    tensors[f"{r}.{key}" + (f".{part}" if part else "")] = t
    path = folder / "shards" / f"{name}.safetensors"
    # one metadata entry: safetensors writes several in hash-map order, and the bytes of a shard must
    # not depend on the process that wrote it
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))
    os.chmod(path, 0o666 & ~_umask())
    record = {"rows": sorted(rows), "bytes": path.stat().st_size, "sha256": sha256_file(path), "stamp": _stamp(path)}
    atomic_write_json(path.with_suffix(".json"), record)
    return record


def remove_partial_writes(folder: Path) -> list[Path]:
    """Temporary files of shard writes a killed capture left behind (removed)."""
    gone = [p for p in (folder / "shards").glob(".*.tmp") if p.is_file()]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def write_manifest(folder: Path, plan: dict) -> dict:
    """``manifest.json``: the plan plus every shard's record; refuses while a shard is missing."""
    done = done_shards(folder)
    names = [shard_name(s, i) for s, i, _, _ in shard_plan(plan["splits"], plan["rows_per_shard"])]
    missing = [n for n in names if n not in done]
    if missing:
        raise CacheError(f"{folder}: {len(missing)} of {len(names)} shards are not written yet (first: {missing[0]})")
    shards = {n: done[n] for n in names}
    manifest = {**plan, "shards": shards, "bytes": sum(s["bytes"] for s in shards.values())}
    atomic_write_json(folder / "manifest.json", manifest)
    return manifest


# -- reading ------------------------------------------------------------------------------------


def read_plan(folder: Path) -> dict | None:
    """``capture.json`` of a cache folder, or None when there is none."""
    try:
        plan = _read_json(Path(folder) / "capture.json", "remove the folder and capture again")
    except FileNotFoundError:
        return None
    if plan.get("format") != FORMAT:
        raise CacheError(f"{folder}/capture.json is not a dflash-trainer feature cache plan")
    if plan.get("version") != VERSION:
        raise CacheError(
            f"{folder} was captured by another dflash-trainer (cache version {plan.get('version')}, this one reads "
            f"{VERSION}): capture it again"
        )
    check_schema(
        _Plan, plan, f"feature cache plan {folder}/capture.json", "remove the folder and capture again", CacheError
    )
    return plan


class CachedRows(Sequence):
    """The packed rows of one split of a cache (``PackedRow`` of int64 ``[L]`` tensors), read on demand."""

    def __init__(self, store: FeatureStore, split: str):
        self.store, self.split = store, split

    def __len__(self) -> int:
        return self.store.manifest["splits"].get(self.split, 0)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        f = self.store.shard_of(self.split, index)
        ids, pos, mask = (f.get_tensor(f"{index}.{k}").long() for k in ("input_ids", "position_ids", "loss_mask"))
        # where rows enter training, as for prepared data: a shard whose ids bit-rotted with its size and
        # time kept (so opening skipped its sha256) is named here, not an IndexError in an embedding
        vocab = (self.store.manifest["data"].get("settings") or {}).get("vocab_size")
        if isinstance(vocab, int) and ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
            path = (
                self.store.folder
                / "shards"
                / f"{shard_name(self.split, index // self.store.rows_per_shard)}.safetensors"
            )
            raise CacheError(
                f"feature shard {path} is corrupt: row {index} holds token id {int(ids.max())} outside the vocabulary "
                f"of {vocab}; check it with dflash-train capture --verify, then capture again"
            )
        return PackedRow(ids, pos, mask)


class FeatureStore:
    """An opened, complete feature cache (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike, *, check_shards: bool = True):
        """``check_shards=False`` (``verify``'s way in): the manifest only, every shard checked later."""
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CacheError(f"data.features {folder} is not a folder (write one with dflash-train capture)")
        plan = read_plan(self.folder)
        if plan is None:
            raise CacheError(f"{folder} holds no feature cache (no capture.json): write one with dflash-train capture")
        try:
            self.manifest = _read_json(self.folder / "manifest.json", "run the capture again to rewrite it")
        except FileNotFoundError:
            done, total = len(done_shards(self.folder)), len(shard_plan(plan["splits"], plan["rows_per_shard"]))
            raise CacheError(
                f"the capture in {folder} is not finished ({done} of {total} shards written): run the same "
                "dflash-train capture command again to continue it"
            ) from None
        where = f"feature cache manifest {self.folder / 'manifest.json'}"
        check_schema(_Manifest, self.manifest, where, "run the capture again to rewrite it", CacheError)
        self.rows_per_shard = self.manifest["rows_per_shard"]
        self.storage: str = self.manifest["settings"]["storage_dtype"]
        self._open: dict[str, object] = {}
        for name, record in self.manifest["shards"].items() if check_shards else ():
            path = self.folder / "shards" / f"{name}.safetensors"
            try:
                stamp = _stamp(path)
            except FileNotFoundError:
                raise CacheError(f"feature shard {path} is missing: capture again") from None
            if stamp[0] != record["bytes"]:
                raise CacheError(
                    f"feature shard {path} is truncated or overwritten: {stamp[0]:,} bytes, its record says "
                    f"{record['bytes']:,}; remove it and its .json, then run the capture again"
                )
            if stamp != record["stamp"] and sha256_file(path) != record["sha256"]:
                raise CacheError(f"feature shard {path} is corrupt (its sha256 differs from its record); capture again")

    @property
    def settings(self) -> dict:
        return self.manifest["settings"]

    def rows(self, split: str) -> CachedRows:
        return CachedRows(self, split)

    def shard_of(self, split: str, index: int):
        """The open shard (a ``safe_open`` handle) holding row ``index`` of ``split``."""
        name = shard_name(split, index // self.rows_per_shard)
        if name not in self._open:
            path = self.folder / "shards" / f"{name}.safetensors"
            try:
                self._open[name] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CacheError(f"feature shard {path} is unreadable ({exc}); capture again") from None
        return self._open[name]

    def has_teacher(self, split: str) -> bool:
        return split == "eval" or bool(self.settings["teacher"])

    def features(self, split: str, index: int, dtype: torch.dtype, need_teacher: bool = True) -> TargetFeatures:
        """Row ``index`` of ``split``: context ``[L, k*H]`` and, if stored and wanted, last hidden ``[L, H]``,
        decoded to ``dtype`` (bit-exact when it is the storage dtype)."""
        f = self.shard_of(split, index)

        def read(key: str) -> torch.Tensor:
            parts = {"": f.get_tensor(f"{index}.{key}")}
            if scale_bytes(self.storage):
                parts["scale"] = f.get_tensor(f"{index}.{key}.scale")
            return decode(parts, dtype)

        last = read("last_hidden") if need_teacher and self.has_teacher(split) else None
        return TargetFeatures(read("context"), last)

    def verify(self, progress=None) -> list[str]:
        """Every shard's problems (missing, other size, other sha256, unreadable header), in words."""
        problems = []
        for name, record in self.manifest["shards"].items():
            path = self.folder / "shards" / f"{name}.safetensors"
            if not path.is_file():
                problems.append(f"{path} is missing")
            elif path.stat().st_size != record["bytes"]:
                problems.append(f"{path} has {path.stat().st_size:,} bytes, its record says {record['bytes']:,}")
            elif sha256_file(path) != record["sha256"]:
                problems.append(f"{path}'s sha256 differs from its record")
            else:
                try:
                    with safe_open(str(path), framework="pt") as f:
                        keys = set(f.keys())
                    want = {f"{r}.input_ids" for r in record["rows"]}
                    if not want <= keys:
                        problems.append(f"{path} lacks rows {sorted(want - keys)[:3]}")
                except SafetensorError as exc:
                    problems.append(f"{path} is unreadable: {exc}")
            if progress is not None:
                progress(record["bytes"])
        return problems
