"""The target's logit post-processing, the one definition every consumer of logits applies.

Cohere-style models multiply the logits by ``logit_scale``; Gemma-style models cap them with
``softcap * tanh(z / softcap)``. The fused loss applies the same transform in place on its chunk
buffers (``logits_into``) and its derivative in the gradient (``chain_to_raw``); the reference loss, acceptance scoring and speculative
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


def logits_into(
    h: torch.Tensor | None, weight: torch.Tensor, t, out: torch.Tensor | None, bias=None
) -> torch.Tensor | None:
    """``[c, H] -> [c, V]`` logits in ``out``'s dtype (fp32/fp64), scaled and soft-capped in place as
    ``t`` (``LossTerms``) says; ``bias`` (``chunks.ChunkBias``) adds a low-rank term to the raw logits
    first (the same GEMM pass, never ``[N, V]``).

    ``out`` is a reused workspace buffer: fresh multi-MB allocations per chunk would page-fault."""
    if h is None:
        return None
    if weight.dtype == out.dtype:
        z = torch.mm(h, weight.T, out=out)
        if bias is not None:
            bias.add_to(z)
    else:  # the GEMM runs in the head's dtype (bf16); logits are upcast per chunk
        raw = h @ weight.T
        if bias is not None:
            bias.add_to(raw)
        z = out.copy_(raw)
    if t.logit_scale != 1.0:
        z.mul_(t.logit_scale)
    if t.softcap:
        z.div_(t.softcap).tanh_().mul_(t.softcap)
    return z


def chain_to_raw(g: torch.Tensor, z: torch.Tensor, t) -> torch.Tensor:
    """Turn a gradient w.r.t. transformed logits ``z`` into one w.r.t. raw logits, in place."""
    if t.softcap:
        factor = z / t.softcap  # d(cap*tanh(r/cap))/dr = 1 - tanh^2 = 1 - (z/cap)^2
        g.mul_(factor.square_().neg_().add_(1.0))
        del factor
    if t.logit_scale != 1.0:
        g.mul_(t.logit_scale)
    return g
