"""Per-slot loss weights of a draft block ``[anchor, MASK x (B-1)]``.

Slot 0 is the known anchor token and never has loss. Two schedules:

- fixed decay (DFlash): ``w_k = exp(-(k-1)/gamma)`` for k >= 1;
- D-PACE (dynamic position-aware CE, arXiv 2605.18810): the weight of slot k is the derivative of the
  expected accepted length ``E = sum_m prod_{j<=m} a_j`` with respect to ``log a_k``, i.e.
  ``w_k = sum_{m>=k} prod_{j<=m} a_j``, where ``a_j`` is the current probability that slot j is
  accepted. Here ``a_j`` is a per-slot statistic the trainer tracks (e.g. a running mean of the
  student's probability of the label at slot j), so weights move toward the slots that currently
  limit acceptance; this slot-level form is this project's reading of the paper, not its code.
"""

from __future__ import annotations

import math

import torch


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``[B]`` float64 on the CPU (callers move it where their rows are): ``w_0 = 0``, ``w_k = exp(-(k-1)/gamma)``."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    w = torch.tensor(
        [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)], dtype=torch.float64, device="cpu"
    )
    return w


def dpace_slot_weights(accept_prob: torch.Tensor) -> torch.Tensor:
    """``[B]`` weights from per-slot acceptance probabilities ``accept_prob`` ``[B]`` (slot 0 ignored).

    Normalized to mean 1 over slots 1..B-1 (the loss divides by the weight sum anyway).
    """
    a = accept_prob.double().clamp(0.0, 1.0)[1:]
    if a.numel() == 0:
        raise ValueError("accept_prob must cover at least slots 0 and 1")
    survival = torch.cumprod(a, 0)  # prod_{j<=m} a_j for m = 1..B-1
    w = survival.flip(0).cumsum(0).flip(0)  # sum_{m>=k}
    w = w / w.mean().clamp(min=1e-12)
    return torch.cat([torch.zeros(1, dtype=torch.float64), w])
