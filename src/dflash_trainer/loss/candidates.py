"""The head's logits at a few candidate ids per row, with a gradient to the hidden states (DFlash2).

DFlash2's selector re-scores each row's K best unary candidates (``LossTerms(top_k=K)`` in the fused loss gives
their ids): it needs ``z[i, k] = transform(h_i . W[ids[i, k]])`` ``[N, K]`` and its gradient w.r.t.
``h``, the head frozen. Plain autograd through ``W[ids]`` would keep the gathered rows ``[N, K, H]``
for the backward (K = 16, H = 4,096: 64K floats per row, more than the hidden state itself by K).
``candidate_logits`` keeps only ``h``, ``ids`` and the ``[N, K]`` output, and gathers the head rows again,
``chunk`` rows at a time, in the forward and in the backward: ``O(chunk * K * H)`` transient memory.

Ids -1 (the fused loss's weight-0 rows) give logit -inf and no gradient.
"""

from __future__ import annotations

import torch

from .logits import transform_logits

# Elements of the gathered [chunk, K, H] block per step when no chunk is given (16 MiB in fp32).
DEFAULT_GATHER_ELEMENTS = 2**22


class _CandidateLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, ids, logit_scale, softcap, chunk):
        f = torch.promote_types(hidden.dtype, torch.float32)
        valid = ids >= 0
        safe = ids.clamp(min=0)
        raw = torch.empty(ids.shape, dtype=f, device=hidden.device)
        for lo in range(0, ids.shape[0], chunk):
            rows = head[safe[lo : lo + chunk]].to(f)  # [c, K, H], dropped after this step
            raw[lo : lo + chunk] = torch.einsum("ckh,ch->ck", rows, hidden[lo : lo + chunk].to(f))
        z = transform_logits(raw, logit_scale, softcap)
        ctx.save_for_backward(hidden, head, safe, valid, z)  # no [N, K, H]
        ctx.logit_scale, ctx.softcap, ctx.chunk = logit_scale, softcap, chunk
        return z.masked_fill(~valid, -torch.inf)

    @staticmethod
    def backward(ctx, grad_z):
        hidden, head, safe, valid, z = ctx.saved_tensors
        # d z / d raw = scale (1 - (z / cap)^2): the chain rule through the transform, from the output
        g = grad_z.to(z.dtype).masked_fill(~valid, 0.0)
        if ctx.softcap:
            g = g * (1 - (z / ctx.softcap).square())
        if ctx.logit_scale != 1.0:
            g = g * ctx.logit_scale
        grad_h = torch.empty(hidden.shape, dtype=z.dtype, device=hidden.device)
        for lo in range(0, safe.shape[0], ctx.chunk):
            rows = head[safe[lo : lo + ctx.chunk]].to(z.dtype)  # the same gather again
            grad_h[lo : lo + ctx.chunk] = torch.einsum("ck,ckh->ch", g[lo : lo + ctx.chunk], rows)
        return grad_h.to(hidden.dtype), None, None, None, None, None


def candidate_logits(
    hidden: torch.Tensor,
    head: torch.Tensor,
    ids: torch.Tensor,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``transform(hidden_i . head[ids[i, k]])`` ``[N, K]`` (fp32, fp64 for fp64 inputs), differentiable
    w.r.t. ``hidden`` ``[N, H]`` only (``head`` ``[V, H]`` is the frozen head, ``ids`` ``[N, K]`` int in
    ``[-1, V)``, -1 giving -inf). ``chunk_size`` rows per gather step (default: about 4M gathered elements)."""
    if hidden.dim() != 2 or head.dim() != 2 or head.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"candidate_logits: hidden [N, H] and head [V, H], got {tuple(hidden.shape)}, {tuple(head.shape)}"
        )
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0] or ids.is_floating_point():
        raise ValueError(
            f"candidate_logits: ids must be an integer [{hidden.shape[0]}, K] tensor, got {tuple(ids.shape)}"
        )
    if head.requires_grad:
        raise ValueError("candidate_logits: the head is frozen (pass head.detach())")
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= head.shape[0]):
        raise ValueError(
            f"candidate_logits: ids must be in [-1, {head.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"candidate_logits: chunk_size must be >= 1, got {chunk_size}")
    chunk = chunk_size or max(1, DEFAULT_GATHER_ELEMENTS // (max(ids.shape[1], 1) * max(hidden.shape[1], 1)))
    return _CandidateLogits.apply(hidden, head, ids.long(), logit_scale, softcap, chunk)


def reference_candidate_logits(
    hidden: torch.Tensor, head: torch.Tensor, ids: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    """The plain version: gather ``[N, K, H]`` and contract, autograd keeping the gathered rows (tests only)."""
    f = torch.promote_types(hidden.dtype, torch.float32)
    raw = torch.einsum("nkh,nh->nk", head[ids.clamp(min=0)].to(f), hidden.to(f))
    return transform_logits(raw, logit_scale, softcap).masked_fill(ids < 0, -torch.inf)
