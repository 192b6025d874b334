"""Pack documents into fixed-length rows, the unit the target and the drafter see.

Document boundaries inside a row are carried by the positions alone: every document restarts at
position 0, and ``doc_ids_from_positions`` starts a new document wherever a position does not
continue the previous one. A non-empty document ends at position ``len - 1 >= 0``, so the next one's
0 can never look like a continuation: the boundaries survive without a separate doc-id tensor.

Rules:
- a document longer than ``seq_len`` is cut into ``seq_len``-token pieces, each its own document
  (positions restart; nothing in one piece attends to another);
- pieces are placed first-fit, in order: each goes into the first row with room for it, else opens a
  new row. The result depends only on the input order (deterministic), and later short documents fill
  gaps left by earlier long ones;
- the unused tail of a row is padding: ``pad_token_id``, ``loss_mask`` 0, positions 0, 1, ... so it
  is a document of its own that nothing real attends to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .documents import Document


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[L]`` document index of each token of a packed row. A new document starts wherever the
    position does not continue the previous one (``p[i] != p[i-1] + 1``), the rule Hugging Face uses
    to keep packed documents apart, so the target and the drafter agree on the boundaries."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[1:] = (position_ids[1:] != position_ids[:-1] + 1).long()
    return starts.cumsum(0) - 1


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the documents of a packed row ``[L]``, in order, covering it."""
    doc = doc_ids_from_positions(position_ids)
    starts = [0, *((doc[1:] != doc[:-1]).nonzero().squeeze(1) + 1).tolist()]
    return list(zip(starts, [*starts[1:], position_ids.numel()]))


@dataclass
class PackedRow:
    """One packed row; every tensor is ``[L]`` long (``L = seq_len``)."""

    input_ids: torch.Tensor  # LongTensor [L]
    position_ids: torch.Tensor  # LongTensor [L], 0 at the start of each document and of the padding
    loss_mask: torch.Tensor  # LongTensor [L], 0 on padding


class _FirstFit:
    """Index of the first row whose free space is >= a size, in O(log n): a max segment tree over the
    free space of ``capacity`` rows. Rows not opened yet have all ``seq_len`` free, so "the first row
    that fits" is either an open row or the next new one, with no special case."""

    def __init__(self, capacity: int, seq_len: int):
        self.size = 1
        while self.size < capacity:
            self.size *= 2
        self.tree = [seq_len] * (2 * self.size)

    def take(self, need: int) -> int:
        """Reserve ``need`` slots in the first row that has them; return that row's index."""
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        row = node - self.size
        self.tree[node] -= need
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return row


def split_document(doc: Document, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` pieces of at most ``seq_len`` tokens, in order."""
    return [
        (doc.input_ids[s : s + seq_len], doc.loss_mask[s : s + seq_len]) for s in range(0, len(doc.input_ids), seq_len)
    ]


def plan_rows(doc_starts: np.ndarray, doc_lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The packing of documents given by index, not by content: ``(row_offsets [R+1], pieces [P, 2])``,
    where row ``r`` holds ``pieces[row_offsets[r]:row_offsets[r+1]]``, in order, each piece a
    ``(token start, length)`` of the flat token storage. Documents are ``doc_starts``/``doc_lengths``
    ``[D]`` (int64, every length >= 1). The same rules and the same rows as ``pack_documents``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    doc_starts, doc_lengths = np.asarray(doc_starts, np.int64), np.asarray(doc_lengths, np.int64)
    if (doc_lengths < 1).any():
        raise ValueError("every document must hold at least one token")
    per_doc = -(-doc_lengths // seq_len)  # pieces of each document
    doc_of_piece = np.repeat(np.arange(len(doc_lengths)), per_doc)
    first_piece = np.cumsum(per_doc) - per_doc
    k = np.arange(len(doc_of_piece)) - first_piece[doc_of_piece]  # piece number inside its document
    starts = doc_starts[doc_of_piece] + k * seq_len
    lengths = np.minimum(seq_len, doc_lengths[doc_of_piece] - k * seq_len)
    fit = _FirstFit(max(1, len(lengths)), seq_len)
    row_of_piece = np.fromiter((fit.take(n) for n in lengths.tolist()), np.int64, len(lengths))
    order = np.argsort(row_of_piece, kind="stable")  # pieces of a row in placement order
    n_rows = int(row_of_piece.max()) + 1 if len(lengths) else 0
    row_offsets = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(row_of_piece, minlength=n_rows), out=row_offsets[1:])
    return row_offsets, np.stack([starts[order], lengths[order]], axis=1).reshape(-1, 2)


def pack_documents(docs: Sequence[Document], seq_len: int, pad_token_id: int) -> list[PackedRow]:
    """Rows of exactly ``seq_len`` tokens holding every token of ``docs`` once (see the module
    docstring): the plain in-memory reference of ``plan_rows`` + ``storage.PackedRows``. Each returned
    tensor is ``[seq_len]``; the number of rows is at least ``ceil(total tokens / seq_len)``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces: list[tuple[list[int], list[int]]] = []
    for doc in docs:
        if len(doc.input_ids) != len(doc.loss_mask):
            raise ValueError(
                f"document {doc.source}:{doc.line} has {len(doc.input_ids)} ids but "
                f"{len(doc.loss_mask)} loss-mask entries"
            )
        if not doc.input_ids:
            raise ValueError(f"document {doc.source}:{doc.line} is empty")
        pieces.extend(split_document(doc, seq_len))
    if not pieces:
        return []

    fit = _FirstFit(len(pieces), seq_len)  # never more rows than pieces
    rows: list[list[tuple[list[int], list[int]]]] = []
    for piece in pieces:
        r = fit.take(len(piece[0]))
        if r == len(rows):
            rows.append([])
        rows[r].append(piece)

    packed = []
    for row in rows:
        ids, pos, mask = [], [], []
        for piece_ids, piece_mask in row:
            ids.extend(piece_ids)
            mask.extend(piece_mask)
            pos.extend(range(len(piece_ids)))
        pad = seq_len - len(ids)
        ids.extend([pad_token_id] * pad)
        mask.extend([0] * pad)
        pos.extend(range(pad))
        packed.append(
            PackedRow(
                input_ids=torch.tensor(ids, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long),
                loss_mask=torch.tensor(mask, dtype=torch.long),
            )
        )
    return packed
