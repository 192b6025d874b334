"""The target's logit post-processing, the one definition every consumer of logits applies.

Cohere-style models multiply the logits by ``logit_scale``; Gemma-style models cap them with
``softcap * tanh(z / softcap)``. The fused loss applies the same transform in place on its chunk
buffers (and its derivative in the gradient); the reference loss, acceptance scoring and speculative
decoding call this function. Which options a target uses is read from its config by
``model.target.head_logit_options``.
"""

from __future__ import annotations

import torch


def transform_logits(z: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """The target's logit post-processing: multiply by ``logit_scale``, then ``softcap * tanh(z / softcap)``."""
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z
