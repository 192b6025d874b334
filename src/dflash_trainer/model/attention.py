"""Attention masks of the drafter's training layout, as a dense boolean mask or a FlexAttention BlockMask.

Queries are the ``nb*B`` block slots (block b = query // B, slot j = query % B). Keys are the ``L``
context rows of the packed row followed by the ``nb*B`` block slots. The rule (DESIGN.md section 2):

    query (b, j) sees context row c  iff  doc(c) == doc(b) and c < anchor(b)
                                          [and c >= anchor(b) - W on sliding-window layers]
    query (b, j) sees block key (b', j') iff b' == b  [and j' <= j if causal inside the block]

Blocks never see each other; padding blocks see only their own keys (their outputs carry no loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskSpec:
    """The per-layer variant of the rule."""

    window: int | None = None  # W context rows, None = all earlier rows of the document
    causal_in_block: bool = False


def dense_mask(
    anchors: torch.Tensor, block_doc: torch.Tensor, context_doc: torch.Tensor, block_size: int, spec: MaskSpec
) -> torch.Tensor:
    """``[nb*B, L + nb*B]`` bool mask (True = may attend) for ``scaled_dot_product_attention``.

    ``anchors``, ``block_doc``: ``[nb]``; ``context_doc``: ``[L]`` document id of each context row.
    """
    nb, length, b = anchors.numel(), context_doc.numel(), block_size
    c = torch.arange(length, device=anchors.device)
    ctx = (context_doc[None, :] == block_doc[:, None]) & (c[None, :] < anchors[:, None])  # [nb, L]
    if spec.window is not None:
        ctx &= c[None, :] >= anchors[:, None] - spec.window
    ctx = ctx.repeat_interleave(b, dim=0)  # [nb*B, L]
    q_block = torch.arange(nb * b, device=anchors.device) // b
    own = q_block[:, None] == q_block[None, :]  # [nb*B, nb*B]
    if spec.causal_in_block:
        slot = torch.arange(nb * b, device=anchors.device) % b
        own &= slot[None, :] <= slot[:, None]
    return torch.cat([ctx, own], dim=1)


def flex_block_mask(
    anchors: torch.Tensor,
    block_doc: torch.Tensor,
    context_doc: torch.Tensor,
    block_size: int,
    spec: MaskSpec,
    kv_block: int = 128,
    q_block: int = 128,
):
    """The same rule as ``dense_mask`` as a FlexAttention ``BlockMask`` (sparse: only tiles with any
    allowed pair are visited, so the cost grows with the context each block really sees)."""
    from torch.nn.attention.flex_attention import create_block_mask

    length, b = context_doc.numel(), block_size
    window, causal = spec.window, spec.causal_in_block

    def mask_mod(_batch, _head, q, kv):
        blk = q // b
        is_ctx = kv < length
        c = torch.clamp(kv, max=length - 1)
        anchor = anchors[blk]
        ctx_ok = is_ctx & (context_doc[c] == block_doc[blk]) & (c < anchor)
        if window is not None:
            ctx_ok = ctx_ok & (c >= anchor - window)
        kb = torch.clamp(kv - length, min=0)
        own = (~is_ctx) & (kb // b == blk)
        if causal:
            own = own & (kb % b <= q % b)
        return ctx_ok | own

    n_q = anchors.numel() * b
    # Uncompiled, create_block_mask evaluates mask_mod densely ([Q, L+Q] temporaries); on GPUs,
    # where the large layouts run, it is compiled and evaluates tile by tile.
    make = _compiled_create_block_mask() if anchors.device.type == "cuda" else create_block_mask
    return make(mask_mod, None, None, n_q, length + n_q, device=anchors.device, BLOCK_SIZE=(q_block, kv_block))


_COMPILED_CREATE = None


def _compiled_create_block_mask():
    global _COMPILED_CREATE
    if _COMPILED_CREATE is None:
        from torch.nn.attention.flex_attention import create_block_mask

        _COMPILED_CREATE = torch.compile(create_block_mask)
    return _COMPILED_CREATE
