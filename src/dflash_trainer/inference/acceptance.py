"""Teacher-forced acceptance of drafter checkpoints: chain and DDTree, as JSON and plots (``dflash-train eval``).

For greedy decoding a block's drafts do not depend on anything inside the block, so acceptance can
be measured on held-out packed rows in one pass, without running the decoding loop
(shared/DESIGN.md section 2). Per block of size B anchored at position a:

    greedy_k = argmax W h_target[a + k - 1]           the target's greedy token for slot k (k = 1..B-1)
    draft_k  = argmax W h_drafter[slot k]             the drafter's chain proposal
    chain:   accepted = longest prefix with draft_k == greedy_k            (0..B-1)
    DDTree:  accepted = depth of the greedy path inside build_tree(log_softmax(W h_drafter[1..B-1]), budget)
             (a variant whose drafts depend on earlier drafts, DSpark: the node-conditioned tree decoding builds)
    tau = mean(accepted + 1)                          (+1: the target's bonus token)

``W`` is the target's frozen ``lm_head`` ``[V, H]``; only the selected rows are projected, a few
blocks at a time, so no ``[L x V]`` (nor ``[blocks x B x V]`` for a big vocabulary) tensor exists.
``teacher_forced_blocks`` is the one scorer: training's periodic evaluation, ``dflash-train eval``
and the decode-path walk all read their drafts and greedy tokens from it, with the configured
attention backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from typing import NamedTuple

import torch

from ..data.blocks import build_blocks, sample_anchors, valid_anchor_positions
from ..data.packing import doc_ids_from_positions
from ..errors import UserError
from ..loss.logits import transform_logits
from ..model.drafter import DFlashDrafter
from ..variants import variant_of
from .ddtree import DraftTree, accepted_per_budget, draft_tree

DEFAULT_BUDGETS = (16, 32, 64, 128, 256, 512)
REPORT_FORMAT = "dflash-trainer-eval/1"
# Logit elements one projection chunk may hold: 2**24 fp32 = 64 MiB. A 248K vocabulary with B = 16
# gives 4 blocks per chunk; the 8K-token tiny target up to 292 at B = 8 (then capped near the row's
# length: teacher_forced_blocks).
MAX_LOGIT_ELEMENTS = 1 << 24


class EvalInputError(UserError, ValueError):
    """A bad evaluation input (budget, block count, data, checkpoint), explained in one line."""


def check_budgets(budgets: Sequence[int]) -> list[int]:
    """Sorted distinct DDTree budgets; each must be an integer >= 1."""
    if not budgets:
        raise EvalInputError("no DDTree budget given")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, Integral) or b < 1]
    if bad:
        raise EvalInputError(f"DDTree budgets must be integers >= 1, got {bad[0]!r}")
    return sorted({int(b) for b in budgets})


# Lower edges of the context-length buckets of ``tau_by_context``: tokens of the anchor's document before
# it. Users report acceptance collapsing past ~100K tokens of context; the buckets make that visible.
CONTEXT_BUCKETS = (0, 1024, 4096, 16384, 32768, 65536, 131072)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def tau_by_context(accepted: torch.Tensor, context: torch.Tensor, edges: Sequence[int] = CONTEXT_BUCKETS) -> list[dict]:
    """Chain tau per context-length bucket: ``accepted`` ``[N]`` drafts accepted per block, ``context``
    ``[N]`` its anchor's position in its document. One ``{"context", "min", "max", "blocks", "tau"}`` per
    bucket ``[min, max)`` holding blocks (``max`` None: the last, open bucket), in order."""
    out = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        inside = (context >= lo) & (context < hi if hi is not None else True)
        n = int(inside.sum())
        if n:
            label = f"{_tokens(lo)}-{_tokens(hi)}" if hi is not None else f">={_tokens(lo)}"
            tau = (accepted[inside].double() + 1).mean().item()
            out.append({"context": label, "min": lo, "max": hi, "blocks": n, "tau": tau})
    return out


class ScoredBlocks(NamedTuple):
    """A few blocks scored by ``teacher_forced_blocks`` (g blocks, D draft slots each)."""

    draft_logits: torch.Tensor  # [g, D, V] the drafter's raw logits of its draft slots
    greedy: torch.Tensor  # [g, D] the target's greedy token for each slot
    tree_of: Callable[[int, int], DraftTree]  # (j, budget) -> block j's DDTree as decoding builds it
    confidence: torch.Tensor | None  # [g, D] the confidence head's predicted acceptance (DSpark), else None
    acceptance: torch.Tensor | None  # [g, D] with ``confidence``: sum_v min(p_v, q_v), target p, drafter q
    candidate_hits: torch.Tensor | None = None  # [g, D] bool: greedy token among the variant's candidates (DFlash2)


@torch.no_grad()
def teacher_forced_blocks(
    target,
    drafter: DFlashDrafter,
    row,
    anchors: torch.Tensor,
    *,
    attention_backend: str = "dense",
    max_logit_elements: int = MAX_LOGIT_ELEMENTS,
) -> Iterator[ScoredBlocks]:
    """The one teacher-forced scorer. For ``anchors`` ``[n]`` of a packed ``row`` (``[L]`` tensors),
    yields ``ScoredBlocks`` a few blocks at a time: the drafter's raw logits of its D draft slots
    (DFlash: slots 1..B-1), the target's greedy token for each, ``tree_of(j, budget)``, block j's
    DDTree as decoding builds it (``ddtree.draft_tree``: DSpark's is node-conditioned), and for a
    drafter with a confidence head its prediction beside the acceptance it predicts. Each chunk holds
    at most ``max_logit_elements`` logits per tensor (never ``[L x V]``) and at most about as many
    block slots as the row has context rows; the drafter runs with ``attention_backend``."""
    b = drafter.spec.block_size
    variant = variant_of(drafter.spec)
    span = b + variant.label_shift(drafter.spec)  # D = span - 1 draft slots (DFlash: B - 1; DSpark: B)
    head = drafter.lm_head_weight  # [V, H]
    dev, vocab = head.device, head.shape[0]
    per_chunk = max(1, max_logit_elements // ((span - 1) * vocab))
    # The dense mask is [g B, L + g B]: its block-to-block part, masked but computed, outgrows the
    # context once g B > L (the decode path scores every anchor of a row). Capping g B near L keeps
    # attention within twice the context part, for one more pass over the context keys per chunk.
    per_chunk = min(per_chunk, max(1, row.input_ids.numel() // b))
    # Anchors and blocks are index bookkeeping, done on the CPU.
    ids, pos, loss_mask = row.input_ids.cpu(), row.position_ids.cpu(), row.loss_mask.cpu()
    doc = doc_ids_from_positions(pos)
    feats = target.features(ids.to(dev), pos.to(dev), need_teacher=True)  # [L, k*H], [L, H]
    for start in range(0, anchors.numel(), per_chunk):
        part = anchors[start : start + per_chunk]
        g = part.numel()
        blocks = build_blocks(
            ids, pos, loss_mask, part, block_size=span, mask_token_id=drafter.spec.mask_token_id, gamma=1.0
        )  # gamma only weights the loss; acceptance ignores it
        masks = drafter.build_masks(blocks.anchors.to(dev), blocks.doc_ids.to(dev), doc.to(dev), attention_backend)
        hidden = drafter(
            blocks.input_ids[:, :b].to(dev),
            blocks.position_ids[:, :b].to(dev),
            feats.context,
            pos.to(dev),
            masks,
            attention_backend,
        ).view(g, b, -1)  # [g, B, H]
        teacher_index = blocks.teacher_index[:, 1:].to(dev)  # [g, D]: the row before each draft's token
        # the target's logits once per distinct row the slots read: consecutive anchors (the decode
        # path scores every one) share D - 1 of them, so up to D times fewer than one per slot
        rows_read, slot_row = teacher_index.unique(return_inverse=True)  # [u], [g, D]
        target_logits = feats.last_hidden[rows_read].to(head.dtype) @ head.T  # [u, V], u <= g D
        greedy = target_logits.argmax(-1)[slot_row]  # [g, D]
        del target_logits  # freed before the drafter's logits exist (a confidence check recomputes them)
        anchor_ids = blocks.input_ids[:, 0].to(dev)
        # [g, D, V], and [g, D] or None; a variant whose drafts depend on earlier drafts (DSpark's Markov
        # walk, DFlash2's selector) walks on its own drafts as decoding does, once for both
        draft_logits, confidence = variant.draft_logits_and_confidence(drafter, hidden, anchor_ids, greedy)
        acceptance = None
        if confidence is not None:  # what the head is trained to predict: sum_v min(p_v, q_v) at T = 1
            opts = drafter.spec.logit_options
            target_logits = feats.last_hidden[rows_read].to(head.dtype) @ head.T  # [u, V]
            p = torch.softmax(transform_logits(target_logits.float(), **opts), dim=-1)[slot_row]  # [g, D, V]
            q = torch.softmax(transform_logits(draft_logits.float(), **opts), dim=-1)
            acceptance = torch.minimum(p, q).sum(-1)
            del p, q, target_logits
        anchor_ids = anchor_ids.tolist()

        def tree_of(j: int, budget: int, hidden=hidden, draft_logits=draft_logits, anchor_ids=anchor_ids):
            def log_probs():
                logits = transform_logits(draft_logits[j].float(), **drafter.spec.logit_options)
                return torch.log_softmax(logits, dim=-1)

            return draft_tree(variant, drafter, hidden[j], anchor_ids[j], log_probs, budget, span - 1)

        hits = variant.candidate_hits(drafter, draft_logits, greedy)
        yield ScoredBlocks(draft_logits, greedy, tree_of, confidence, acceptance, hits)
        del draft_logits, hidden, tree_of


@torch.no_grad()
def acceptance_report(
    target,
    drafter: DFlashDrafter,
    rows: Sequence,
    *,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    max_blocks_per_row: int = 64,
    seed: int = 1234,
    attention_backend: str = "dense",
    max_logit_elements: int = MAX_LOGIT_ELEMENTS,
    decode_path: bool = True,
    context_buckets: Sequence[int] = CONTEXT_BUCKETS,
) -> dict:
    """Chain and DDTree acceptance of ``drafter`` against ``target``'s greedy tokens on packed ``rows``.

    ``target`` is a ``TargetModel``; each row is a ``PackedRow`` (``[L]`` tensors, on the CPU or the
    target's device). Up to ``max_blocks_per_row`` anchors per row are drawn with a generator seeded
    by ``seed``. ``budgets`` may be empty (chain only, as training's periodic evaluation asks);
    ``decode_path`` adds the decode-path tau. Returns (B = block size, N = blocks evaluated):

        tau                     chain tau, mean(accepted + 1)
        tau_by_context          chain tau per bucket of the anchor's position in its document
                                (``tau_by_context``, ``CONTEXT_BUCKETS``)
        slot_acceptance         [B-1]  P(draft_k == greedy_k), slots 1..B-1
        conditional_acceptance  [B-1]  P(draft_k == greedy_k | slots 1..k-1 accepted); None where no
                                       block got that far
        reach                   [B-1]  P(accepted >= k); sums to tau - 1
        accepted_histogram      [B]    blocks with 0..B-1 accepted drafts; sums to N
        budgets, ddtree_tau     DDTree tau per budget (same order)
        confidence              (a drafter with a confidence head, DSpark) per draft slot: mean predicted
                                and measured acceptance sum_v min(p_v, q_v) at T = 1, and mean |error|
        candidate_recall        (a drafter that drafts from candidates, DFlash2) per draft slot and
                                overall: P(greedy token among the unary top K)
        decode_tau, decode_rounds  (with ``decode_path``)
        blocks, rows, rows_without_blocks, block_size
    """
    budgets = check_budgets(budgets) if budgets else []
    if isinstance(max_blocks_per_row, bool) or not isinstance(max_blocks_per_row, int) or max_blocks_per_row < 1:
        raise EvalInputError(f"max blocks per row must be an integer >= 1, got {max_blocks_per_row!r}")
    if not rows:
        raise EvalInputError("no evaluation rows: the data set is empty")
    b = drafter.spec.block_size
    span = b + variant_of(drafter.spec).label_shift(drafter.spec)  # D = span - 1 drafts per block
    gen = torch.Generator().manual_seed(seed)
    accepted_parts, match_parts, tree_parts, confidence_parts, hit_parts = [], [], [], [], []
    context_parts = []  # [n] per row: each sampled anchor's position in its document
    rows_used = rows_empty = 0
    was_training = drafter.training
    drafter.eval()
    try:
        for row in rows:
            doc = doc_ids_from_positions(row.position_ids.cpu())
            anchors = sample_anchors(row.loss_mask.cpu(), doc, span, max_blocks_per_row, gen)
            if anchors.numel() == 0:
                rows_empty += 1
                continue
            rows_used += 1
            context_parts.append(row.position_ids.cpu()[anchors])  # the blocks below come in anchor order
            for scored in teacher_forced_blocks(
                target,
                drafter,
                row,
                anchors,
                attention_backend=attention_backend,
                max_logit_elements=max_logit_elements,
            ):
                match = scored.draft_logits.argmax(-1) == scored.greedy  # [g, D]
                accepted_parts.append(match.long().cumprod(1).sum(1).cpu())
                match_parts.append(match.cpu())
                for j, path in enumerate(scored.greedy.tolist() if budgets else []):
                    # one tree of the largest budget; a smaller budget's tree is its first nodes
                    tree_parts.append(accepted_per_budget(scored.tree_of(j, budgets[-1]), path, budgets))
                if scored.confidence is not None:
                    confidence_parts.append((scored.confidence.double().cpu(), scored.acceptance.double().cpu()))
                if scored.candidate_hits is not None:
                    hit_parts.append(scored.candidate_hits.double().cpu())
    finally:
        drafter.train(was_training)
    if not accepted_parts:
        raise EvalInputError(
            f"no valid block of {span} tokens in {len(rows)} evaluation rows (an anchor needs "
            f"loss_mask 1 and {span - 1} more tokens of the same document)"
        )
    accepted = torch.cat(accepted_parts)  # [N]
    match = torch.cat(match_parts).double()  # [N, B-1]
    total = accepted.numel()
    reach_counts = [(accepted >= k).sum().item() for k in range(span)]  # reach_counts[0] == N
    conditional = [reach_counts[k] / reach_counts[k - 1] if reach_counts[k - 1] else None for k in range(1, span)]
    report = {
        "block_size": b,
        "blocks": total,
        "rows": rows_used,
        "rows_without_blocks": rows_empty,
        "tau": (accepted.double() + 1).mean().item(),
        "slot_acceptance": match.mean(0).tolist(),
        "conditional_acceptance": conditional,
        "reach": [c / total for c in reach_counts[1:]],
        "accepted_histogram": torch.bincount(accepted, minlength=span).tolist(),
        "budgets": budgets,
        "ddtree_tau": (torch.tensor(tree_parts, dtype=torch.float64) + 1).mean(0).tolist() if budgets else [],
        "tau_by_context": tau_by_context(accepted, torch.cat(context_parts), context_buckets),
    }
    if confidence_parts:  # the confidence head's calibration per draft slot, over the same blocks
        predicted = torch.cat([c for c, _ in confidence_parts])  # [N, D]
        measured = torch.cat([a for _, a in confidence_parts])
        report["confidence"] = {
            "predicted": predicted.mean(0).tolist(),
            "measured": measured.mean(0).tolist(),
            "abs_error": (predicted - measured).abs().mean().item(),
        }
    if hit_parts:  # DFlash2: how often the target's greedy token is among the selector's K candidates
        hits = torch.cat(hit_parts)  # [N, D]
        report["candidate_recall"] = {"per_slot": hits.mean(0).tolist(), "mean": hits.mean().item()}
    if decode_path:
        decode = decode_path_acceptance(
            target, drafter, rows, attention_backend=attention_backend, max_logit_elements=max_logit_elements
        )
        report = {"decode_tau": decode["tau"], "decode_rounds": decode["rounds"], **report}
    return report


@torch.no_grad()
def decode_path_acceptance(
    target,
    drafter: DFlashDrafter,
    rows: Sequence,
    *,
    attention_backend: str = "dense",
    max_logit_elements: int = MAX_LOGIT_ELEMENTS,
) -> dict:
    """Tau along the path greedy speculative decoding takes through each document's response.

    The sampled-anchor ``tau`` weights every position alike; decoding visits an anchor, accepts ``a``
    drafts and jumps to ``anchor + a + 1``, so it spends more rounds where drafts fail. Here every
    valid anchor's teacher-forced acceptance is computed in the training layout, then each document
    is walked from its first loss position the way ``speculate --mode chain`` walks it:
    ``tau = mean(a + 1)`` over the visited anchors. On the target's own greedy responses this is the
    tau that speculative decoding measures (tested against it). ``{"tau", "rounds", "var"}``: ``var``
    is the variance of the tokens per round (a + 1) over the visited rounds.
    """
    span = drafter.spec.block_size + variant_of(drafter.spec).label_shift(drafter.spec)
    was_training = drafter.training
    drafter.eval()
    visited = []
    try:
        for row in rows:
            doc = doc_ids_from_positions(row.position_ids.cpu())
            anchors = valid_anchor_positions(row.loss_mask.cpu(), doc, span)
            if anchors.numel() == 0:
                continue
            counts = []
            for scored in teacher_forced_blocks(
                target,
                drafter,
                row,
                anchors,
                attention_backend=attention_backend,
                max_logit_elements=max_logit_elements,
            ):
                counts += (scored.draft_logits.argmax(-1) == scored.greedy).long().cumprod(1).sum(1).tolist()
            accepted = dict(zip(anchors.tolist(), counts))
            for d in doc[anchors].unique().tolist():  # walk each document from its first valid anchor
                p = int(anchors[doc[anchors] == d][0])
                while p in accepted:
                    visited.append(accepted[p])
                    p += accepted[p] + 1
    finally:
        drafter.train(was_training)
    if not visited:
        return {"tau": None, "rounds": 0, "var": None}
    tau = sum(a + 1 for a in visited) / len(visited)
    return {"tau": tau, "rounds": len(visited), "var": sum((a + 1 - tau) ** 2 for a in visited) / len(visited)}
