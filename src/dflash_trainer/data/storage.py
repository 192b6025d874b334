"""Prepared data on disk: flat token storage and packing plans, memory-mapped, and the rows they hold.

A prepared-data folder (written by ``prepare``, read by every rank) holds raw little-endian arrays
that numpy memory-maps, as nanoGPT's and Megatron's token files are:

    manifest.json       what the storage was prepared from and with (``prepare`` compares it with a
                        run), counts, and every file's dtype, shape, bytes and sha256
    stamps.json         each file's size and modification time as written
    tokens.bin          uint32 [n_tokens]    the kept documents' token ids, in input order
    loss_mask.bin       uint8  [n_tokens]
    doc_offsets.bin     int64  [n_docs + 1]  document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]
    {split}_rows.bin    int64  [R + 1]       packed row r of a split is pieces[rows[r]:rows[r + 1]]
    {split}_pieces.bin  int64  [P, 2]        (token start, length) of each piece, in row order
    data_report.json    the bad-record report of the training inputs (eval_data_report.json: held-out)

5 bytes per token plus 16 per document piece; a row costs nothing until it is read. Opening checks
every file's size against the manifest (a truncated file is one line naming it), the small index
arrays' invariants, and the sha256 of any file whose size or modification time differs from what
``stamps.json`` recorded (``verify`` checks every file's sha256).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from ..errors import JsonRecord, UserError, check_schema
from ..io import sha256_file
from .documents import DataReport
from .packing import PackedRow

FORMAT = "dflash-trainer prepared data"
VERSION = 1
SPLITS = ("train", "eval")
# What the storage costs, for the planner: on disk per token (uint32 id + uint8 mask), per document (its
# offset + one (start, length) piece; a document longer than a row has one piece per row it spans)
# and per row (its offset); in RAM per row and rank, what training keeps beside the memory map (the
# epoch order, int64, and the row's usability, int8).
DISK_BYTES_PER_TOKEN = 5
DISK_BYTES_PER_DOCUMENT = 8 + 16
DISK_BYTES_PER_ROW = 8
RAM_BYTES_PER_ROW = 8 + 1


class StorageError(UserError):
    """A prepared-data folder that cannot be used; the message names the file and the problem."""


# The manifest's schema: what the readers below use, checked in one place (strict JSON types; extra keys
# are kept for later versions' additions). A file's shape, dtype and size must agree, and each array
# has the dtype this reader was written for: a manifest edited by hand is one line, not an mmap error.
_DTYPES = {"tokens": "uint32", "loss_mask": "uint8", "doc_offsets": "int64"} | {
    f"{s}_{k}": "int64" for s in SPLITS for k in ("rows", "pieces")
}


class _File(JsonRecord):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+\.bin$")  # a file in the folder, never a path out of it
    dtype: str
    shape: list[int]
    bytes: int = Field(ge=0)
    sha256: str


class _Settings(JsonRecord):
    train_paths: list[str]
    eval_paths: list[str]
    holdout: str
    eval_fraction: float | None
    seq_len: int = Field(gt=0)
    min_tokens: int
    vocab_size: int = Field(gt=0)
    pad_token_id: int = Field(ge=0)
    max_record_bytes: int
    columns: dict[str, str]
    tokenizer: str


class _Input(JsonRecord):
    path: str
    bytes: int
    mtime_ns: int
    probe: str | None = None  # absent in storage prepared before it was recorded


class _Split(JsonRecord):
    documents: int = Field(ge=0)
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)


class _Manifest(JsonRecord):
    format: str
    version: int
    settings: _Settings
    inputs: dict[str, list[_Input]]
    splits: dict[str, _Split]
    n_tokens: int = Field(ge=0)
    n_documents: int = Field(ge=0)
    files: dict[str, _File]


def holds_prepared_data(folder: Path) -> bool:
    """Whether ``folder`` has a prepared-data manifest of this project's (any version; its contents
    unchecked): what ``prepare-data --out`` may replace."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.is_file():
        raise StorageError(f"{folder} is not prepared data: no manifest.json (dflash-train prepare-data writes one)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StorageError(f"{path} is unreadable or corrupt: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        if (folder / "capture.json").is_file():
            raise StorageError(
                f"{folder} is a feature cache (dflash-train capture), not prepared data: train from it with "
                f"--set data.features={folder}"
            )
        raise StorageError(f"{path} is not a dflash-trainer prepared-data manifest")
    if manifest.get("version") != VERSION:
        raise StorageError(
            f"{folder} was prepared by another dflash-trainer (storage version {manifest.get('version')}, this one "
            f"reads {VERSION}): prepare it again"
        )
    fix = "prepare the data again (dflash-train prepare-data)"
    parsed = check_schema(_Manifest, manifest, f"prepared data manifest {path}", fix, StorageError)
    for split in SPLITS:
        if split not in parsed.splits or split not in parsed.inputs:
            raise StorageError(
                f"prepared data manifest {path}: field splits.{split} or inputs.{split} is missing; {fix}"
            )
    for name, dtype in _DTYPES.items():
        info = parsed.files.get(name)
        if info is None:
            raise StorageError(f"prepared data manifest {path}: field files.{name} is missing; {fix}")
        if info.dtype != dtype or np.prod(info.shape, dtype=np.int64) * np.dtype(dtype).itemsize != info.bytes:
            raise StorageError(
                f"prepared data manifest {path}: field files.{name} is inconsistent (dtype {info.dtype!r:.20}, shape "
                f"{info.shape}, {info.bytes:,} bytes; this reader wants {dtype}); {fix}"
            )
        if len(info.shape) != (2 if name.endswith("_pieces") else 1) or (
            name.endswith("_pieces") and info.shape[1] != 2
        ):
            raise StorageError(
                f"prepared data manifest {path}: field files.{name}.shape {info.shape} is not the array's; {fix}"
            )
    return manifest


class PackedRows(Sequence):
    """The packed rows of one split, read from the memory map on demand: ``rows[i]`` is a ``PackedRow``
    of ``[seq_len]`` tensors (int64), ``rows[a:b]`` a list of them. Nothing is held per row."""

    def __init__(self, data: PreparedData, split: str):
        self.tokens, self.loss_mask = data.array("tokens"), data.array("loss_mask")
        self.offsets, self.pieces = data.array(f"{split}_rows"), data.array(f"{split}_pieces")
        self.seq_len, self.pad = data.settings["seq_len"], data.settings["pad_token_id"]
        self.vocab_size, self.tokens_path = data.settings["vocab_size"], data.folder / "tokens.bin"

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        pieces = self.pieces[self.offsets[index] : self.offsets[index + 1]]
        ids = np.full(self.seq_len, self.pad, np.int64)
        mask = np.zeros(self.seq_len, np.int64)
        pos = np.empty(self.seq_len, np.int64)
        at = 0
        for start, length in pieces.tolist():
            ids[at : at + length] = self.tokens[start : start + length]
            mask[at : at + length] = self.loss_mask[start : start + length]
            pos[at : at + length] = np.arange(length)
            at += length
        pos[at:] = np.arange(self.seq_len - at)  # the padding is a document of its own
        # Where rows enter training: an id the vocabulary does not hold (bit rot that kept the file's size
        # and time, so opening skipped the sha256) would be an IndexError deep in the target's embedding.
        if at and (ids[:at].max() >= self.vocab_size or self.pad >= self.vocab_size):
            raise StorageError(
                f"prepared data file {self.tokens_path} is corrupt: row {index} holds token id {int(ids.max())}, the "
                f"vocabulary has {self.vocab_size}; check it with dflash-train prepare-data --verify and prepare it again"
            )
        return PackedRow(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(mask))


class PreparedData:
    """An opened prepared-data folder (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.manifest = _read_manifest(self.folder)
        self.settings: dict = self.manifest["settings"]
        self._arrays: dict[str, np.ndarray] = {}
        try:
            stamps = json.loads((self.folder / "stamps.json").read_text())
        except (OSError, ValueError):
            stamps = {}  # copied without it, or damaged: every file's sha256 is checked
        if not isinstance(stamps, dict):
            stamps = {}  # damaged the same way
        for name, info in self.manifest["files"].items():
            path = self.folder / info["name"]
            try:
                st = path.stat()
            except FileNotFoundError:
                raise StorageError(f"prepared data file {path} is missing: prepare the data again") from None
            if st.st_size != info["bytes"]:
                raise StorageError(
                    f"prepared data file {path} is truncated or overwritten: {st.st_size:,} bytes, the manifest says "
                    f"{info['bytes']:,}; prepare the data again"
                )
            if stamps.get(name) != [st.st_size, st.st_mtime_ns] and sha256_file(path) != info["sha256"]:
                raise StorageError(f"prepared data file {path} is corrupt (its sha256 differs from the manifest's)")
        self._check_indices()

    def array(self, name: str) -> np.ndarray:
        """The memory-mapped array ``name`` (``tokens``, ``loss_mask``, ``doc_offsets``, ``train_rows``, ...)."""
        if name not in self._arrays:
            info = self.manifest["files"][name]
            shape = tuple(info["shape"])
            path = self.folder / info["name"]
            # np.memmap refuses an empty file: an empty split is an empty array.
            self._arrays[name] = (
                np.memmap(path, dtype=info["dtype"], mode="r", shape=shape)
                if info["bytes"]
                else np.zeros(shape, info["dtype"])
            )
        return self._arrays[name]

    def _check_indices(self) -> None:
        """The index arrays point inside the token storage (they are small: one entry per document or piece)."""
        n_tokens = len(self.array("tokens"))
        offsets = np.asarray(self.array("doc_offsets"))
        problem = None
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != n_tokens or (np.diff(offsets) <= 0).any():
            problem = "doc_offsets"
        for split in SPLITS:
            rows, pieces = np.asarray(self.array(f"{split}_rows")), np.asarray(self.array(f"{split}_pieces"))
            starts, lengths = pieces[:, 0], pieces[:, 1]
            if (
                len(rows) == 0
                or rows[0] != 0
                or rows[-1] != len(pieces)
                or (np.diff(rows) < 0).any()
                or (lengths < 1).any()
                or (starts < 0).any()
                or (starts + lengths > n_tokens).any()
            ):
                problem = problem or f"{split}_rows / {split}_pieces"
        if problem:
            raise StorageError(f"prepared data in {self.folder} is corrupt: {problem} do not index the token storage")

    def rows(self, split: str) -> PackedRows:
        """The packed rows of ``split`` (``train`` or ``eval``)."""
        return PackedRows(self, split)

    def report(self, split: str) -> DataReport:
        """The bad-record report of ``split``'s inputs, as preparation wrote it."""
        path = self.folder / ("data_report.json" if split == "train" else "eval_data_report.json")
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            return DataReport(
                files=d["files"],
                n_records=d["n_records"],
                n_documents=d["n_documents"],
                n_tokens=d["n_tokens"],
                n_loss_tokens=d["n_loss_tokens"],
                bad=[(b["file"], b["line"], b["reason"]) for b in d["bad"]],
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StorageError(f"prepared data report {path} is missing or corrupt: {exc}") from None

    def verify(self) -> list[str]:
        """Every file's sha256 checked against the manifest; the problems found (empty: all good)."""
        problems = []
        for info in self.manifest["files"].values():
            path = self.folder / info["name"]
            if sha256_file(path) != info["sha256"]:
                problems.append(f"{path}: sha256 differs from the manifest's (corrupt)")
        return problems
