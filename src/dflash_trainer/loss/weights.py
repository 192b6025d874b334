"""Per-slot loss weights of a draft block ``[anchor, MASK x (B-1)]``.

Slot 0 is the known anchor token and never has loss. The fixed decay of DFlash,
``w_k = exp(-(k-1)/gamma)`` for k >= 1, is ``loss.position_weights: exp_decay``. D-PACE
(``loss.position_weights: dpace``) replaces these weights by a per-row block credit computed inside
the fused loss from the student's detached label probabilities (``LossTerms.credit``, ``BlockCredit("label_prob")``).
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
