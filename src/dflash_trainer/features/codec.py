"""How one feature tensor is stored: as it is (float32 / bfloat16 / float16), or FP8 with a scale.

FP8 (``float8_e4m3fn``, largest finite value 448) keeps one float32 scale per token row: row ``i`` of
``x [L, D]`` is stored as ``round_fp8(x_i / s_i)`` with ``s_i = max|x_i| / 448`` (``s_i = 1`` for an
all-zero row), and read back as ``fp8_i * s_i``. A per-row scale follows the hidden state's norm, which
varies by orders of magnitude across positions (the first token's state is far larger); one scale
per tensor would flush the small rows to zero.
"""

from __future__ import annotations

import torch

STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3": torch.float8_e4m3fn,
}
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
DECODE_ROWS = 4096


def element_bytes(storage: str) -> int:
    """Bytes per stored element of a ``STORAGE_DTYPES`` name."""
    return STORAGE_DTYPES[storage].itemsize


def scale_bytes(storage: str) -> int:
    """Bytes per token row of the scale an encoding adds (FP8: one float32)."""
    return 4 if storage == "float8_e4m3" else 0


def encode(x: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """``x [L, D]`` -> ``{"": stored [L, D]}`` and, for FP8, ``{"scale": [L] float32}``; CPU, contiguous."""
    x = x.detach().to("cpu")
    if storage != "float8_e4m3":
        return {"": x.to(STORAGE_DTYPES[storage]).contiguous()}
    x = x.float()
    amax = x.abs().amax(dim=-1)  # [L]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"": q.contiguous(), "scale": scale.contiguous()}


def decode(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``encode``, in ``dtype``: ``[L, D]``. Exact for a storage dtype equal to ``dtype``."""
    stored = parts[""]
    if "scale" not in parts:
        return stored.to(dtype)
    scale = parts["scale"]
    out = torch.empty(stored.shape, dtype=dtype, device=stored.device)
    for i in range(0, stored.shape[0], DECODE_ROWS):  # fp32 temporaries of DECODE_ROWS rows, not of L
        out[i : i + DECODE_ROWS] = stored[i : i + DECODE_ROWS].float() * scale[i : i + DECODE_ROWS, None]
    return out
