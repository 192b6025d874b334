"""Anchors and draft blocks of a packed row (shared/DESIGN.md section 2).

A block is ``[anchor token, MASK x (B-1)]`` at positions ``pos(anchor) + k``. Slot k's label is the
token at ``anchor + k``; slot 0 (the known anchor token) has no loss, nor has a slot whose target
position has ``loss_mask`` 0. The teacher for slot k is the target's final-normed hidden state at
``anchor + k - 1`` (the row that predicts the token at ``anchor + k``): an index, not a roll.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..loss.weights import slot_weights
from .packing import doc_ids_from_positions


def valid_anchor_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions p with ``loss_mask[p] == 1`` whose block p..p+B-1 lies inside p's document. ``[n_valid]``"""
    length = loss_mask.numel()
    if length < block_size:
        return torch.zeros(0, dtype=torch.long, device=loss_mask.device)
    p = torch.arange(length - block_size + 1, device=loss_mask.device)
    ok = loss_mask[p].bool() & (doc_ids[p + block_size - 1] == doc_ids[p])
    return p[ok]


def sample_anchors(
    loss_mask: torch.Tensor, doc_ids: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Up to ``max_anchors`` distinct valid anchors, sorted, drawn uniformly with ``generator``. ``[n]``"""
    valid = valid_anchor_positions(loss_mask, doc_ids, block_size)
    if valid.numel() <= max_anchors:
        return valid
    pick = torch.randperm(valid.numel(), generator=generator, device=generator.device)[:max_anchors].to(valid.device)
    return valid[pick].sort().values


@dataclass
class Blocks:
    """All draft blocks of one packed row, padded to ``num_blocks`` (padding blocks have weight 0)."""

    anchors: torch.Tensor  # [nb] anchor positions (0 for padding blocks)
    valid: torch.Tensor  # [nb] bool, False for padding blocks
    input_ids: torch.Tensor  # [nb, B] anchor token then MASK
    position_ids: torch.Tensor  # [nb, B] pos(anchor) + k
    labels: torch.Tensor  # [nb, B] token at anchor + k (0 where there is no loss)
    weights: torch.Tensor  # [nb, B] exp(-(k-1)/gamma) where the slot has loss, else 0
    teacher_index: torch.Tensor  # [nb, B] row index anchor + k - 1 of the teacher hidden state
    doc_ids: torch.Tensor  # [nb] document of each block

    @property
    def block_size(self) -> int:
        return self.input_ids.shape[1]


def build_blocks(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    num_blocks: int | None = None,
) -> Blocks:
    """Blocks for ``anchors`` ``[n]`` of a row (``input_ids``, ``position_ids``, ``loss_mask`` ``[L]``),
    padded with weight-0 blocks up to ``num_blocks`` (default n)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    n = anchors.numel()
    nb = n if num_blocks is None else num_blocks
    if nb < n:
        raise ValueError(f"num_blocks {nb} is below the {n} anchors")
    length = input_ids.numel()
    if n and int(anchors.max()) + block_size > length:
        raise ValueError(f"anchor {int(anchors.max())} + block_size {block_size} runs past the row of {length} tokens")
    doc_ids = doc_ids_from_positions(position_ids)
    dev = input_ids.device
    k = torch.arange(block_size, device=dev)
    padded = torch.zeros(nb, dtype=torch.long, device=dev)
    padded[:n] = anchors
    valid = torch.zeros(nb, dtype=torch.bool, device=dev)
    valid[:n] = True
    idx = padded[:, None] + k  # [nb, B]
    block_ids = torch.full((nb, block_size), mask_token_id, dtype=input_ids.dtype, device=dev)
    block_ids[:, 0] = input_ids[padded]
    labels = input_ids[idx].clone()
    has_loss = loss_mask[idx].bool() & valid[:, None]
    has_loss[:, 0] = False
    weights = slot_weights(block_size, gamma).to(dev, torch.float32)[None, :].expand(nb, -1) * has_loss
    labels[~has_loss] = 0
    return Blocks(
        anchors=padded,
        valid=valid,
        input_ids=block_ids,
        position_ids=position_ids[padded][:, None] + k,
        labels=labels,
        weights=weights,
        teacher_index=(idx - 1).clamp(min=0),
        doc_ids=doc_ids[padded],
    )
