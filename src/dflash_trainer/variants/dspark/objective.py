"""DSpark's objective: the fused loss with the Markov bias folded into its GEMM, the acceptance,
Renyi-1/2 and D-PARD terms through the loss's pair terms, and the confidence head's BCE."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...loss import BlockCredit, LossTerms, PairTerm
from ...model.drafter import DFlashDrafter, DrafterSpec
from .settings import DSparkSettings


class DSparkObjective:
    """The loss hooks of ``Variant``."""

    def needs_teacher(self, o: DSparkSettings) -> bool:
        return o.confidence_head or o.renyi_weight > 0 or o.position_weights == "dpard"

    def batch_extras(self, spec: DrafterSpec, input_ids: torch.Tensor, anchors: torch.Tensor) -> dict:
        """``prev_ids`` ``[nb*B]``: slot k's previous token, the row's token at ``anchor + k + shift - 1``
        (never before the anchor: slot 0 without sample_from_anchor has no loss and reads the anchor)."""
        b, shift = spec.block_size, self.label_shift(spec)
        k = torch.arange(b, device=anchors.device)
        idx = torch.maximum(anchors[:, None] + k + shift - 1, anchors[:, None])
        return {"prev_ids": input_ids[idx].reshape(-1)}

    def head_inputs(self, drafter: DFlashDrafter, prev_ids: torch.Tensor, hidden: torch.Tensor):
        """``(bias features f [N, r], confidence logits [N] or None)`` of rows ``[N, H]`` in blocks of B."""
        b = drafter.spec.block_size
        n, h = hidden.shape
        feat, emb = drafter.markov_head.features(prev_ids.view(-1, b), hidden.view(-1, b, h))
        conf = None
        if hasattr(drafter, "confidence_head"):
            x = hidden.to(emb.dtype)
            if self.settings(drafter.spec).confidence_head_with_markov:
                x = torch.cat([x, emb.reshape(n, -1)], dim=-1)
            conf = drafter.confidence_head(x)
        return feat.reshape(n, -1), conf

    def loss(
        self, drafter: DFlashDrafter, hidden, teacher, head, batch, terms: LossTerms, options: dict, *, reference: bool
    ):
        o, spec = self.settings(drafter.spec), drafter.spec
        b = spec.block_size
        feat, conf = self.head_inputs(drafter, batch.extras["prev_ids"], hidden)
        dpard = o.position_weights == "dpard"
        if self.needs_teacher(o):  # acceptance a = the overlap, Renyi-1/2 (weighted by renyi_weight), D-PARD
            own = (PairTerm("accept", "overlap"), PairTerm("renyi", "renyi_half", weight=o.renyi_weight))
            credit = BlockCredit("overlap", o.dpard_alpha) if dpard else terms.credit
            terms = replace(terms, pair_terms=own + terms.pair_terms, credit=credit)
        loss, metrics = self.draft_loss(
            drafter,
            hidden,
            teacher,
            head,
            batch,
            terms,
            options,
            reference=reference,
            bias_rows=feat.to(head.dtype),
            bias_weight=drafter.markov_head.markov_w2.weight.to(head.dtype),
        )
        if conf is not None:
            # BCE against the measured acceptance, detached, on the fixed slot weights (as speculators:
            # D-PARD's credit is for the token terms), as a weighted mean like the other terms.
            accept = metrics["overlap_rows"].detach().to(conf.dtype)
            w = batch.weights.to(conf.dtype)
            bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
            conf_loss = (w * bce).sum() / w.sum().clamp(min=1e-12)
            loss = loss + o.confidence_alpha * conf_loss.to(loss.dtype)
            with torch.no_grad():
                keep = w > 0
                metrics["confidence_bce"] = conf_loss.detach()
                metrics["confidence_pred"] = conf.sigmoid()[keep].mean() if keep.any() else conf.new_zeros(())
                # calibration per slot: predicted vs measured acceptance, summed over rows with loss
                slots = batch.slots[keep]
                metrics["confidence_per_slot"] = {
                    "rows": torch.zeros(b, dtype=torch.float64, device=conf.device).index_add_(
                        0, slots, torch.ones_like(slots, dtype=torch.float64)
                    ),
                    "predicted": torch.zeros(b, dtype=torch.float64, device=conf.device).index_add_(
                        0, slots, conf.sigmoid()[keep].double()
                    ),
                    "measured": torch.zeros(b, dtype=torch.float64, device=conf.device).index_add_(
                        0, slots, accept[keep].double()
                    ),
                }
                metrics["confidence_abs_error"] = (
                    (conf.sigmoid() - accept).abs()[keep].mean() if keep.any() else conf.new_zeros(())
                )
        return loss, metrics
