"""The drafter's rotary position tables: default RoPE, or scaled for long context (``drafter.rope_scaling``).

Scaling follows the definitions transformers reads from a config's ``rope_parameters`` (so an export
that records them is served the same way; ``tests/test_rope.py`` compares with transformers' own
``ROPE_INIT_FUNCTIONS`` in float64):

    default  inv_freq_i = theta^(-2i/d),                          i = 0 .. d/2 - 1
    linear   inv_freq_i / factor                                  (position interpolation)
    yarn     inv_freq_i * r_i + inv_freq_i / factor * (1 - r_i)   (NTK-by-parts), cos and sin times
             attention_factor (default 0.1 ln(factor) + 1)

where YaRN's ``r_i`` is 1 for the fast dimensions (more than ``beta_fast`` rotations over the original
context), 0 for the slow ones (fewer than ``beta_slow``), linear in between; the boundaries are the
dimensions ``d ln(L0 / (2 pi beta)) / (2 ln theta)`` (floored and ceiled when ``truncate``) with
``L0 = original_max_position_embeddings``. All of it in float64, cast at the end.
"""

from __future__ import annotations

import math

import torch


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's cos/sin scale: ``attention_factor``, else ``0.1 ln(factor) + 1`` (1 for factor <= 1)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, device=None) -> tuple[torch.Tensor, float]:
    """``([head_dim / 2] float64 inverse frequencies, cos/sin scale)`` of the RoPE ``scaling`` describes
    (None: default RoPE). ``scaling``: ``{"rope_type": "linear" | "yarn", "factor", ...}``."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r}: the drafter computes default, linear and yarn RoPE")
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def boundary(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = boundary(beta_fast), boundary(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by zero (transformers does the same)
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (fast dimensions keep their frequency), 0: interpolate
    return inv_freq * keep + inv_freq / factor * (1 - keep), yarn_attention_factor(scaling)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T] -> ([T, d], [T, d])`` rotary tables (HF's rotate-half layout), scaled by ``scaling``."""
    inv_freq, scale = rope_inv_freq(head_dim, theta, scaling, positions.device)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[heads, T, d]`` rotated by position tables ``[T, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
