"""Training documents from records: token ids and loss masks, with every bad record counted.

``document_arrays`` turns one record into token ids and a loss mask or the reason it is bad; it is the
one rule both ``load_documents`` (in memory, the plain reference) and ``prepare`` (to disk, in
parallel) apply. ``load_documents`` turns each record of ``records.iter_records`` into a ``Document`` (chat records
through the tokenizer's chat template, ``chat.tokenize_conversation``; pre-tokenized records as they
are) or into one line of a ``DataReport``. Bad records are skipped, never silently: the report counts
them by reason and lists file, line and reason for each. When too many are bad, the report is written
and the run stops with a one-line ``UserError`` that points at it.

Reasons a record is bad, besides those of ``records.parse_record`` (invalid JSON, empty conversation,
unknown role, no assistant turn, ...):

- ``template error``: the chat template failed or is not prefix-stable for this conversation;
- ``token id out of range``: an id outside ``[0, vocab_size)`` (pre-tokenized records, or a tokenizer
  with more tokens than the model);
- ``empty assistant turn``: an assistant turn that is empty or only whitespace (``generate`` treats
  such a turn as an empty generation; training on it would teach the drafter to stop at once);
- ``no assistant tokens``: nothing has ``loss_mask`` 1 after masking;
- ``too short``: fewer than ``min_tokens`` tokens, or no position ``p`` with ``loss_mask[p] == 1`` that
  has at least ``min_tokens - 1`` tokens after it. With ``min_tokens`` = the block size this is exactly
  "the document has at least one valid anchor" (``anchors.valid_anchor_positions``).
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..io import atomic_write_json
from .chat import tokenize_conversation
from .records import DEFAULT_MAX_RECORD_BYTES, BadRecord, Record, expand_paths, iter_records

# records.py puts the offending value after these prefixes ("unknown role 'robot'"); the count is by
# the prefix so one category does not splinter into one entry per distinct value.
_PREFIX_KINDS = ("unknown role", "a turn without text")


@dataclass
class Document:
    """One training document: ``input_ids`` and ``loss_mask`` ``[T]``, and where it came from."""

    input_ids: list[int]
    loss_mask: list[int]
    source: str  # file path
    line: int  # 1-based line number in ``source``


def reason_kind(reason: str) -> str:
    """The stable category of a bad-record reason: the part before ``":"`` (this module's reasons are
    ``"kind: detail"``), or one of records.py's prefixes."""
    for kind in _PREFIX_KINDS:
        if reason.startswith(kind):
            return kind
    return reason.split(":", 1)[0]


@dataclass
class DataReport:
    """What ``load_documents`` read: record and token totals, bad records by kind, and each bad one."""

    files: list[str] = field(default_factory=list)
    n_records: int = 0  # good + bad
    n_documents: int = 0
    n_tokens: int = 0  # over kept documents
    n_loss_tokens: int = 0
    bad: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, reason)

    @property
    def n_bad(self) -> int:
        return len(self.bad)

    @property
    def counts(self) -> dict[str, int]:
        """Bad records by kind (``reason_kind``), most frequent first."""
        return dict(Counter(reason_kind(r) for _, _, r in self.bad).most_common())

    @property
    def bad_fraction(self) -> float:
        return self.n_bad / self.n_records if self.n_records else 0.0

    def to_dict(self) -> dict:
        return {
            "files": self.files,
            "n_records": self.n_records,
            "n_documents": self.n_documents,
            "n_bad": self.n_bad,
            "bad_fraction": self.bad_fraction,
            "n_tokens": self.n_tokens,
            "n_loss_tokens": self.n_loss_tokens,
            "counts": self.counts,
            "bad": [{"file": f, "line": n, "reason": r} for f, n, r in self.bad],
        }

    def write(self, path: str | os.PathLike) -> Path:
        """Write the report as JSON, atomically (``io.atomic_write_json``). Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_json(path, self.to_dict())


def _check_document(ids: list[int], mask: list[int], vocab_size: int, min_tokens: int) -> str | None:
    """Why ``ids``/``mask`` ``[T]`` cannot be trained on, or None."""
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        return f"token id out of range: {bad_ids[0]} not in [0, {vocab_size})"
    if not any(mask):
        return "no assistant tokens: loss_mask is all 0"
    # Loss positions p with p + min_tokens - 1 < T, i.e. p < T - min_tokens + 1.
    if len(ids) < min_tokens or not any(mask[: len(ids) - min_tokens + 1]):
        return f"too short: {len(ids)} tokens, no loss position with {min_tokens - 1} tokens after it"
    return None


def document_arrays(record: Record, tokenizer, vocab_size: int, min_tokens: int) -> tuple[list[int], list[int]] | str:
    """``(input_ids, loss_mask)`` ``[T]`` of a record, or the reason the record is bad."""
    if record.messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            # A setup problem, not a data problem: every chat record would fail the same way.
            raise UserError(f"the tokenizer has no chat template, needed for the chat records of {record.source}")
        if any(m["role"] == "assistant" and not m["content"].strip() for m in record.messages):
            return "empty assistant turn"
        try:
            ids, mask = tokenize_conversation(tokenizer, record.messages)
        except ValueError as e:
            return f"template error: {e}"
    else:
        ids, mask = record.input_ids, record.loss_mask
    reason = _check_document(ids, mask, vocab_size, min_tokens)
    return reason if reason is not None else (list(ids), list(mask))


def check_report(report: DataReport, max_bad_fraction: float, report_path: str | os.PathLike | None) -> None:
    """Raise the one-line ``UserError`` when the share of bad records exceeds ``max_bad_fraction`` or no
    record is usable, after writing the report (to ``report_path``, else a fresh temporary file, named in
    the message); otherwise write it to ``report_path`` when one is given."""
    if report.bad_fraction > max_bad_fraction or not report.n_documents:
        if report_path is None:
            fd, report_path = tempfile.mkstemp(prefix="dflash-data-report-", suffix=".json")
            os.close(fd)
        written = report.write(report_path)
        if report.n_records == 0:
            raise UserError(f"no records in {', '.join(report.files)}")
        if not report.n_documents:
            raise UserError(f"no usable document among {report.n_records} records; see the report {written}")
        raise UserError(
            f"{report.n_bad} of {report.n_records} records are bad ({report.bad_fraction:.1%}), above "
            f"max_bad_fraction {max_bad_fraction:.1%}; see the report {written}"
        )
    if report_path is not None:
        report.write(report_path)


def load_documents(
    paths: list[str],
    tokenizer,
    *,
    vocab_size: int,
    min_tokens: int,
    max_bad_fraction: float,
    report_path: str | os.PathLike | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    columns: dict[str, str] | None = None,
) -> tuple[list[Document], DataReport]:
    """Every usable document of the data paths ``paths``, in file and line order, and the report: the
    plain in-memory reference of ``prepare.prepare_data`` (which writes the same documents to disk).

    ``vocab_size`` is the target model's (ids must index its embedding); ``min_tokens`` is usually the
    block size (see the module docstring); lines longer than ``max_record_bytes`` are bad records. The report is written to ``report_path`` when one is given.
    Raises ``UserError`` when the share of bad records exceeds ``max_bad_fraction`` (after writing the
    report, to ``report_path`` or else a fresh temporary file, named in the message) or when no record
    at all is usable."""
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    report = DataReport(files=[str(p) for p in expand_paths(paths)])
    documents: list[Document] = []
    for item in iter_records(paths, max_record_bytes, columns):
        report.n_records += 1
        if isinstance(item, BadRecord):
            report.bad.append((item.source, item.line, item.reason))
            continue
        result = document_arrays(item, tokenizer, vocab_size, min_tokens)
        if isinstance(result, str):
            report.bad.append((item.source, item.line, result))
            continue
        documents.append(Document(input_ids=result[0], loss_mask=result[1], source=item.source, line=item.line))
        report.n_tokens += len(result[0])
        report.n_loss_tokens += sum(result[1])
    report.n_documents = len(documents)
    check_report(report, max_bad_fraction, report_path)
    return documents, report
