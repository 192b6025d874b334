"""DFlash2's objective (speculators' split objective): the configured DFlash loss on the unary logits,
with their top K out of the fused loss's chunk loop, plus the selector's K-way cross-entropy."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...errors import UserError
from ...loss import LossTerms
from ...loss.candidates import candidate_logits
from ...model.drafter import DFlashDrafter, DrafterSpec


def selector_training_candidates(topk_ids: torch.Tensor, labels: torch.Tensor):
    """``[n, K]`` unary top-K ids and ``[n]`` labels -> (candidates ``[n, K]``, the label's position
    ``[n]``, label among the top K ``[n]`` bool): a label outside the top K replaces the weakest."""
    match = topk_ids == labels[:, None]
    inside = match.any(-1)
    k = topk_ids.shape[1]
    position = torch.where(inside, match.long().argmax(-1), torch.full_like(labels, k - 1))
    candidates = topk_ids.clone()
    candidates[:, -1] = torch.where(inside, candidates[:, -1], labels)
    return candidates, position, inside


class DFlash2Objective:
    """The loss hooks of ``Variant``."""

    def batch_extras(self, spec: DrafterSpec, input_ids: torch.Tensor, anchors: torch.Tensor) -> dict:
        """``prev_ids`` ``[nb*B]``: slot k's predecessor, the row's token at ``anchor + k - 1`` (slot 0,
        which has no loss, reads the anchor)."""
        k = torch.arange(spec.block_size, device=anchors.device)
        idx = torch.maximum(anchors[:, None] + k - 1, anchors[:, None])
        return {"prev_ids": input_ids[idx].reshape(-1)}

    def loss(
        self, drafter: DFlashDrafter, hidden, teacher, head, batch, terms: LossTerms, options: dict, *, reference: bool
    ):
        o = self.settings(drafter.spec)
        if terms.label_source != "data":
            raise UserError(
                "drafter.variant dflash2 trains its selector on the data labels: set loss.label_source=data"
            )
        topk = replace(terms, top_k=o.selector_top_k)
        loss, metrics = self.draft_loss(drafter, hidden, teacher, head, batch, topk, options, reference=reference)
        sel_loss, sel_metrics = self.selector_loss(drafter, hidden, head, batch, metrics["topk_ids"], terms)
        metrics.update(sel_metrics)
        return loss + o.selector_alpha * sel_loss.to(loss.dtype), metrics

    def selector_loss(self, drafter: DFlashDrafter, hidden, head, batch, topk_ids, terms: LossTerms):
        """The K-way cross-entropy of the selector over the rows with weight > 0 (``hidden`` ``[N, H]``,
        ``topk_ids`` ``[N, K]`` from the loss's chunk loop), as a weighted mean like the base loss's
        terms; metrics ``candidate_recall`` (label among the unary top K) and ``selector_accuracy``
        (the selector's argmax is the label, over the rows where it could be)."""
        rows = (batch.weights > 0).nonzero().squeeze(1)
        w = batch.weights[rows].to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        labels = batch.labels[rows]
        candidates, position, inside = selector_training_candidates(topk_ids[rows], labels)
        h = hidden[rows]
        unary = candidate_logits(h, head, candidates, terms.logit_scale, terms.softcap)
        selector = drafter.candidate_selector
        context = selector.context(h, batch.extras["prev_ids"][rows])
        scores = unary.to(w.dtype) + selector.transition(context, candidates).to(w.dtype)  # [n, K]
        ce = F.cross_entropy(scores, position, reduction="none")
        loss = (w * ce).sum() / w.sum().clamp(min=1e-12)
        with torch.no_grad():
            chosen = scores.argmax(-1) == position
            slots = batch.slots[rows]
            b = drafter.spec.block_size
            per_slot = lambda x: torch.zeros(b, dtype=torch.float64, device=x.device).index_add_(0, slots, x.double())  # noqa: E731
            metrics = {
                "selector_ce": loss.detach(),
                "candidate_recall": inside.double().mean() if rows.numel() else torch.zeros((), dtype=torch.float64),
                "selector_accuracy": (chosen & inside).double().sum() / inside.sum().clamp(min=1),
                "selector_per_slot": {
                    "rows": per_slot(torch.ones_like(inside, dtype=torch.float64)),
                    "recall": per_slot(inside),
                    "correct": per_slot(chosen & inside),
                },
            }
        return loss, metrics
