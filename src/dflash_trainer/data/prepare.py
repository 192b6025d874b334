"""Tokenize once, in parallel, into memory-mapped storage (``storage``); find or build it for a run.

``prepare_data`` reads the records of the training (and held-out) inputs incrementally, hands batches
of them to ``num_workers`` processes that decode and tokenize them with the one rule of
``documents.document_arrays``, and appends the results, in input order, to the flat token files: the
output is byte-identical whatever the worker count, and the bad-record report counts every record by
file and line exactly as ``documents.load_documents`` does. The packing plan (``packing.plan_rows``)
is computed from the document lengths alone. Memory stays bounded by the batches in flight.

What a storage depends on is its *settings*: the tokenizer (its full serialized state and chat
template, hashed), ``seq_len``, the shortest usable document, the target's vocabulary size, the pad
id, the record size limit, the column mapping, the held-out rule and the input paths; plus the input
files' sizes and modification times. ``ensure_prepared`` keys a cache folder by the settings, rebuilds
it (saying why) when the input files changed since, and reuses it otherwise; ``open_prepared`` opens
a folder the user names (``data.prepared``) and refuses one whose settings or inputs differ from the
run's, naming the difference. Nothing is silently reused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..io import atomic_folder, atomic_write_json, remove_dead_folders
from .documents import DataReport, document_arrays
from .records import BadRecord, decode_record
from .sources import TABLE_SUFFIXES, OversizedLine, RawRecord, expand_paths, iter_raw_records, table_rows

BATCH_RECORDS = 256  # records per task handed to a worker
BATCH_BYTES = 4 << 20  # ... or fewer, when they hold this many bytes
MIN_BYTES_PER_WORKER = 16 << 20


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cache_root() -> Path:
    """``DFLASH_DATA_CACHE``, else ``~/.cache/dflash-trainer/data``: where prepared data is cached."""
    if os.environ.get("DFLASH_DATA_CACHE"):
        return Path(os.environ["DFLASH_DATA_CACHE"]).expanduser()
    return Path.home() / ".cache" / "dflash-trainer" / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything of ``tokenizer`` that changes token ids or masks: its serialized state
    (vocabulary, merges, normalizer, added tokens), chat template and special-token ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, tokenizer.chat_template, tokenizer.pad_token_id, tokenizer.eos_token_id]
    return hashlib.sha256((state + json.dumps(extra, default=str)).encode()).hexdigest()


@dataclass(frozen=True)
class DataRequest:
    """What a run asks of its data: the inputs and every setting the prepared storage depends on.

    ``holdout``: ``"files"`` (the held-out rows come from ``eval_paths``), ``"fraction"`` (the last
    ``eval_fraction`` of the training documents, as ``setup`` always did) or ``"none"`` (``eval``:
    every document is scored)."""

    train_paths: tuple[str, ...]
    eval_paths: tuple[str, ...]
    holdout: str
    eval_fraction: float
    seq_len: int
    min_tokens: int
    vocab_size: int
    pad_token_id: int
    max_record_bytes: int
    columns: tuple[tuple[str, str], ...] = ()
    tokenizer: str = ""  # tokenizer_fingerprint

    def settings(self) -> dict:
        """The manifest's ``settings``: paths resolved, so a run from another folder matches."""
        return {
            "train_paths": [_resolved(p) for p in self.train_paths],
            "eval_paths": [_resolved(p) for p in self.eval_paths],
            "holdout": self.holdout,
            "eval_fraction": self.eval_fraction if self.holdout == "fraction" else None,
            "seq_len": self.seq_len,
            "min_tokens": self.min_tokens,
            "vocab_size": self.vocab_size,
            "pad_token_id": self.pad_token_id,
            "max_record_bytes": self.max_record_bytes,
            "columns": dict(self.columns),
            "tokenizer": self.tokenizer,
        }

    def key(self) -> str:
        """The cache folder's name: a hash of the settings."""
        return hashlib.sha256(json.dumps(self.settings(), sort_keys=True).encode()).hexdigest()[:20]


def request_for(
    data_cfg, tokenizer, vocab_size: int, min_tokens: int, *, train_paths=None, holdout: str | None = None
) -> DataRequest:
    """The ``DataRequest`` of a ``config.DataConfig``: its files (``train_paths`` instead, e.g. ``eval``'s
    ``--data``) and its held-out rule (``holdout`` instead: ``"none"`` for ``eval``)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    holdout = holdout or ("files" if data_cfg.eval_files else "fraction")
    return DataRequest(
        train_paths=tuple(data_cfg.train_files if train_paths is None else train_paths),
        eval_paths=tuple(data_cfg.eval_files) if holdout == "files" else (),
        holdout=holdout,
        eval_fraction=data_cfg.eval_fraction,
        seq_len=data_cfg.seq_len,
        min_tokens=min_tokens,
        vocab_size=vocab_size,
        pad_token_id=pad,
        max_record_bytes=data_cfg.max_record_bytes,
        columns=tuple(sorted(data_cfg.columns.items())),
        tokenizer=tokenizer_fingerprint(tokenizer),
    )


def find_storage(data_cfg, request: DataRequest, tokenizer, *, progress: bool = True, log=print) -> Path:
    """The folder of the run's prepared storage: ``data.prepared`` (checked against ``request``; when the
    run names no input files, only the settings are compared), else the cache, prepared if needed."""
    if data_cfg.prepared:
        return open_prepared(data_cfg.prepared, request, with_inputs=bool(request.train_paths)).folder
    return ensure_prepared(
        request, tokenizer, root=data_cfg.cache_dir, num_workers=data_cfg.num_workers, progress=progress, log=log
    ).folder


def _resolved(path: str) -> str:
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path  # a Hub name stays a name


PROBE_BYTES = 64 << 10


def _probe(path: Path, size: int) -> str:
    """sha256 of a file's first and last ``PROBE_BYTES`` (all of a small file): an edit there is seen
    even when the size and modification time were kept; 128 KiB read per file, whatever its size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(PROBE_BYTES))
        if size > PROBE_BYTES:
            f.seek(max(PROBE_BYTES, size - PROBE_BYTES))
            h.update(f.read(PROBE_BYTES))
    return h.hexdigest()


def input_files(paths) -> list[dict]:
    """``[{path, bytes, mtime_ns, probe}]`` of the files ``paths`` name: what "the inputs changed" compares."""
    out = []
    for f in expand_paths(list(paths)):
        st = f.stat()
        probe = _probe(f, st.st_size) if f.is_file() else None  # a datasets folder's files are listed one by one
        out.append({"path": str(f.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "probe": probe})
    return out


# -- the workers ----------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_pickle: bytes, vocab_size: int, min_tokens: int, max_record_bytes: int, columns) -> None:
    _WORKER.update(
        tokenizer=pickle.loads(tokenizer_pickle),
        vocab_size=vocab_size,
        min_tokens=min_tokens,
        max_record_bytes=max_record_bytes,
        columns=dict(columns),
    )


@dataclass
class BatchResult:
    """One batch of records, tokenized: the kept documents' ids/mask (concatenated) and lengths."""

    n_records: int
    ids: np.ndarray  # uint32 [tokens of the kept documents]
    mask: np.ndarray  # uint8 [same]
    lengths: np.ndarray  # int64 [kept documents]
    bad: list[tuple[str, int, str]] = field(default_factory=list)


def tokenize_batch(batch: list[RawRecord | OversizedLine]) -> BatchResult:
    """Decode, normalize and tokenize ``batch`` (in a worker, or in this process with one worker)."""
    w = _WORKER
    ids: list[int] = []
    mask: list[int] = []
    lengths: list[int] = []
    bad = []
    for raw in batch:
        record = decode_record(raw, w["max_record_bytes"], w["columns"])
        if isinstance(record, BadRecord):
            bad.append((record.source, record.line, record.reason))
            continue
        result = document_arrays(record, w["tokenizer"], w["vocab_size"], w["min_tokens"])
        if isinstance(result, str):
            bad.append((record.source, record.line, result))
            continue
        ids.extend(result[0])
        mask.extend(result[1])
        lengths.append(len(result[0]))
    return BatchResult(
        len(batch), np.asarray(ids, np.uint32), np.asarray(mask, np.uint8), np.asarray(lengths, np.int64), bad
    )


def _batches(files: list[Path], max_record_bytes: int):
    """``(batch, input bytes it stands for)``: records grouped by count and size, in order."""
    batch, size = [], 0
    per_row = {f: f.stat().st_size / max(1, table_rows(f)) for f in files if f.suffix in TABLE_SUFFIXES}
    for raw in iter_raw_records(files, max_record_bytes):
        batch.append(raw)
        if isinstance(raw, OversizedLine):
            size += raw.size
        elif isinstance(raw.payload, bytes):
            size += len(raw.payload)
        else:
            size += per_row[Path(raw.source)]
        if len(batch) >= BATCH_RECORDS or size >= BATCH_BYTES:
            yield batch, size
            batch, size = [], 0
    if batch:
        yield batch, size


def _in_order(batches, pool: ProcessPoolExecutor | None, in_flight: int):
    """``(BatchResult, bytes)`` in input order; at most ``in_flight`` batches submitted at once."""
    if pool is None:
        for batch, size in batches:
            yield tokenize_batch(batch), size
        return
    pending: deque = deque()
    for batch, size in batches:
        pending.append((pool.submit(tokenize_batch, batch), size))
        if len(pending) >= in_flight:
            future, s = pending.popleft()
            yield future.result(), s
    while pending:
        future, s = pending.popleft()
        yield future.result(), s


class _Appender:
    """An array file written in pieces, hashed as it is written."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype, self.count, self.sha = path, dtype, 0, hashlib.sha256()
        self.file = open(path, "wb")

    def write(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.count += len(array)

    def close(self, shape: tuple[int, ...]) -> dict:
        self.file.close()
        return {
            "name": self.path.name,
            "dtype": self.dtype,
            "shape": list(shape),
            "bytes": self.path.stat().st_size,
            "sha256": self.sha.hexdigest(),
        }


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _write_array(folder: Path, name: str, array: np.ndarray, dtype: str) -> dict:
    out = _Appender(folder / f"{name}.bin", dtype)
    out.write(array.reshape(-1))
    return out.close(array.shape)


def prepare_data(
    request: DataRequest, tokenizer, out: str | os.PathLike, *, num_workers: int | None = None, progress: bool = True
) -> Path:
    """Write the prepared storage of ``request`` to the folder ``out`` (atomically: a reader sees the
    old folder or the complete new one) and return it. ``num_workers`` defaults to the cores (fewer
    for a small input)."""
    from tqdm import tqdm

    from .packing import plan_rows  # packing imports torch: the workers (this module) never need it

    train_files = expand_paths(list(request.train_paths))
    eval_files = expand_paths(list(request.eval_paths)) if request.holdout == "files" else []
    total_bytes = sum(f.stat().st_size for f in train_files + eval_files)
    # A worker costs a second or two to start (it imports transformers): by default each gets at least
    # MIN_BYTES_PER_WORKER of input. The output does not depend on the count.
    workers = num_workers or max(1, min(default_workers(), -(-total_bytes // MIN_BYTES_PER_WORKER)))
    t0 = time.monotonic()
    init = (pickle.dumps(tokenizer), request.vocab_size, request.min_tokens, request.max_record_bytes, request.columns)
    pool = None
    if workers > 1:
        # spawn, not fork: the parent may hold torch's threads; a worker imports no torch.
        pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=init)
    else:
        _init_worker(*init)
    # On stdout: stderr stays the one error line of a failing command.
    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare data",
        disable=not progress,
        file=sys.stdout,
        mininterval=1,
    )
    out = Path(out)
    try:
        with atomic_folder(out) as tmp:
            tokens, masks = _Appender(tmp / "tokens.bin", "uint32"), _Appender(tmp / "loss_mask.bin", "uint8")
            lengths: list[np.ndarray] = []
            reports = {}
            for split, files in (("train", train_files), ("eval", eval_files)):
                report = reports[split] = DataReport(files=[str(f) for f in files])
                for result, size in _in_order(_batches(files, request.max_record_bytes), pool, 2 * workers):
                    tokens.write(result.ids)
                    masks.write(result.mask)
                    lengths.append(result.lengths)
                    report.n_records += result.n_records
                    report.n_documents += len(result.lengths)
                    report.n_tokens += len(result.ids)
                    report.n_loss_tokens += int(result.mask.sum(dtype=np.int64))
                    report.bad.extend(result.bad)
                    bar.update(size)
                    bar.set_postfix_str(
                        f"{tokens.count / max(1e-9, time.monotonic() - t0) / 1e3:,.0f}K tok/s, {tokens.count:,} tokens"
                    )
            files = {"tokens": tokens.close((tokens.count,)), "loss_mask": masks.close((masks.count,))}
            doc_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
            doc_offsets = np.zeros(len(doc_lengths) + 1, np.int64)
            np.cumsum(doc_lengths, out=doc_offsets[1:])
            files["doc_offsets"] = _write_array(tmp, "doc_offsets", doc_offsets, "int64")
            n_train = reports["train"].n_documents
            if request.holdout == "fraction":
                n_eval = max(1, int(n_train * request.eval_fraction)) if n_train > 1 else 0
                splits = {"train": (0, n_train - n_eval), "eval": (n_train - n_eval, n_train)}
            else:
                splits = {"train": (0, n_train), "eval": (n_train, len(doc_lengths))}
            counts = {}
            for split, (a, b) in splits.items():
                row_offsets, pieces = plan_rows(doc_offsets[a:b], doc_lengths[a:b], request.seq_len)
                files[f"{split}_rows"] = _write_array(tmp, f"{split}_rows", row_offsets, "int64")
                files[f"{split}_pieces"] = _write_array(tmp, f"{split}_pieces", pieces, "int64")
                counts[split] = {
                    "documents": b - a,
                    "rows": len(row_offsets) - 1,
                    "tokens": int(doc_offsets[b] - doc_offsets[a]),
                }
            reports["train"].write(tmp / "data_report.json")
            if request.holdout == "files":
                reports["eval"].write(tmp / "eval_data_report.json")
            from .storage import FORMAT, VERSION

            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "settings": request.settings(),
                "inputs": {"train": input_files(request.train_paths), "eval": input_files(request.eval_paths)},
                "splits": counts,
                "n_tokens": tokens.count,
                "n_documents": len(doc_lengths),
                "files": files,
            }
            atomic_write_json(tmp / "manifest.json", manifest)
            # Not in the manifest (which must not depend on when it was written): the files' sizes and
            # modification times as written, so that opening skips the sha256 of an untouched file.
            atomic_write_json(tmp / "stamps.json", {n: _stamp(tmp / f["name"]) for n, f in files.items()})
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if progress:
        elapsed = time.monotonic() - t0
        print(
            f"prepared {tokens.count:,} tokens ({len(doc_lengths):,} documents) in {elapsed:.1f} s with {workers} "
            f"worker(s), {tokens.count / max(elapsed, 1e-9) / 1e3:,.0f}K tokens/s -> {out}",
            flush=True,
        )
    return out


# -- finding the storage of a run -----------------------------------------------------------------


_INPUT_SETTINGS = ("holdout", "eval_fraction", "train_paths", "eval_paths")


def setting_differences(manifest: dict, request: DataRequest, with_inputs: bool = True) -> list[str]:
    """Why a storage does not serve ``request``: each setting that differs, in words (without the
    input settings unless ``with_inputs``)."""
    have, want = manifest["settings"], request.settings()
    names = {
        "tokenizer": "the tokenizer or its chat template",
        "seq_len": "data.seq_len",
        "min_tokens": "the shortest usable document (drafter.block_size + 1)",
        "vocab_size": "the target's vocabulary size",
        "pad_token_id": "the pad token id",
        "max_record_bytes": "data.max_record_bytes",
        "columns": "data.columns",
        "holdout": "the held-out rule (data.eval_files / eval_fraction)",
        "eval_fraction": "data.eval_fraction",
        "train_paths": "the training inputs",
        "eval_paths": "the held-out inputs",
    }
    out = []
    for key, label in names.items():
        if not with_inputs and key in _INPUT_SETTINGS:
            continue
        if have.get(key) != want.get(key):
            if key == "tokenizer":
                out.append(f"{label} differ")
            else:
                out.append(f"{label}: prepared with {have.get(key)!r}, this run has {want.get(key)!r}")
    return out


def changed_inputs(manifest: dict) -> list[str]:
    """Input files that are new, gone or changed (size or modification time) since preparation."""
    out = []
    for split, recorded in manifest["inputs"].items():
        paths = manifest["settings"]["train_paths" if split == "train" else "eval_paths"]
        try:
            now = {f["path"]: f for f in input_files(paths)} if paths else {}
        except UserError as exc:
            return [str(exc)]
        before = {f["path"]: f for f in recorded}
        for path in before.keys() - now.keys():
            out.append(f"{path} is gone")
        for path in now.keys() - before.keys():
            out.append(f"{path} is new")
        for path in before.keys() & now.keys():
            if (before[path]["bytes"], before[path]["mtime_ns"]) != (now[path]["bytes"], now[path]["mtime_ns"]):
                out.append(f"{path} changed (size or modification time)")
            elif before[path].get("probe", now[path]["probe"]) != now[path]["probe"]:
                out.append(f"{path} changed (its first or last {PROBE_BYTES >> 10} KiB)")
    return sorted(out)


def open_prepared(folder: str | os.PathLike, request: DataRequest | None = None, with_inputs: bool = True):
    """``storage.PreparedData`` of a folder the user named; with ``request``, refused (one line naming
    the first difference) when its settings differ from the run's, or (``with_inputs``: the run names
    its input files) its inputs do, or they changed since preparation."""
    from .storage import PreparedData

    data = PreparedData(folder)
    if request is not None:
        problems = setting_differences(data.manifest, request, with_inputs)
        if with_inputs:
            problems += changed_inputs(data.manifest)
        if problems:
            raise UserError(
                f"prepared data {folder} does not match this run: {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; prepare it again (dflash-train prepare-data) or run with its settings"
            )
    return data


def ensure_prepared(
    request: DataRequest,
    tokenizer,
    *,
    root: str | os.PathLike | None = None,
    num_workers: int | None = None,
    progress: bool = True,
    log=print,
):
    """The cached storage of ``request`` under ``root`` (default ``cache_root()``), prepared on first
    use and prepared again, with the reason said, when its inputs changed since. Concurrent callers
    (several runs, several ranks on one machine) wait for one another on a file lock."""
    from .storage import PreparedData, StorageError

    folder = Path(root or cache_root()) / request.key()
    if folder.parent.exists() and not folder.parent.is_dir():
        raise UserError(f"the data cache {folder.parent} is not a folder: set data.cache_dir (or DFLASH_DATA_CACHE)")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(folder.parent / f".{folder.name}.lock", "a")
    except OSError as exc:
        # A read-only cache (a shared data set mount): nobody can be writing in it, so its complete,
        # up-to-date storage is used as it is, without the lock; anything else cannot be prepared there.
        data = _read_only_cache(folder, log)
        if data is None:
            raise UserError(
                f"the data cache {folder.parent} is not writable ({exc.strerror}) and holds no up-to-date prepared "
                "data for this run: set data.cache_dir (or DFLASH_DATA_CACHE) to a writable folder"
            ) from None
        return data
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Folders of killed preparations, of any settings (cache keys hold no dot); a live one is kept.
        for p in folder.parent.glob(".*"):
            if p.is_dir():
                remove_dead_folders(folder.parent / p.name[1:].split(".")[0])
        reason = None
        if (folder / "manifest.json").is_file():
            try:
                data = PreparedData(folder)
                changes = changed_inputs(data.manifest)
                if not changes:
                    log(f"data: prepared storage {folder} (reused: inputs and settings unchanged)")
                    return data
                reason = f"the inputs changed since it was prepared: {'; '.join(changes[:3])}"
            except StorageError as exc:
                reason = str(exc)
            log(f"data: preparing {folder} again, {reason}")
        else:
            log(f"data: preparing {folder} (first use of these inputs and settings)")
        prepare_data(request, tokenizer, folder, num_workers=num_workers, progress=progress)
        return PreparedData(folder)


def _read_only_cache(folder: Path, log):
    """The storage in ``folder`` of a cache that cannot be written, or None when it is absent, damaged
    or its inputs changed since."""
    from .storage import PreparedData, StorageError

    if not (folder / "manifest.json").is_file():
        return None
    try:
        data = PreparedData(folder)
    except StorageError:
        return None
    if changed_inputs(data.manifest):
        return None
    log(f"data: prepared storage {folder} (reused from a read-only cache: inputs and settings unchanged)")
    return data
