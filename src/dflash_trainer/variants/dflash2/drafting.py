"""DFlash2's drafting: the selector walk over a block's unary top K (one drafter pass, only the
selector walks), and DDTree children scored after each node's own token."""

from __future__ import annotations

import torch

from ...loss.logits import transform_logits
from ...model.drafter import DFlashDrafter


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Scores in fp32 (fp64 stays fp64), as the other variants' inference logits."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class DFlash2Drafting:
    """The drafting hooks of ``Variant``."""

    @torch.no_grad()
    def walk(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor):
        """Blocks ``hidden`` ``[g, B, H]`` with anchor tokens ``[g]`` -> (scores ``[g, D, V]``: each slot's
        selector scores at its K candidates, -inf elsewhere; the selected drafts ``[g, D]``), D = B - 1:
        slot by slot, each conditioned on the token selected before it (the anchor for slot 1)."""
        spec, selector = drafter.spec, drafter.candidate_selector
        unary = transform_logits(_upcast(drafter.block_logits(hidden[:, 1:])), **spec.logit_options)  # [g, D, V]
        top, cand = unary.topk(selector.top_k, dim=-1)  # [g, D, K]
        projected = selector.hidden_projection(hidden[:, 1:].to(selector.predecessor_codebook.dtype))  # [g, D, r]
        prev, drafts, rows = anchors.long(), [], []
        for k in range(cand.shape[1]):
            context = selector.predecessor_codebook[prev] * projected[:, k]
            scores = top[:, k] + selector.transition(context, cand[:, k]).to(top.dtype)  # [g, K]
            rows.append(scores)
            prev = cand[:, k].gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
            drafts.append(prev)
        scores = torch.stack(rows, 1)
        full = torch.full_like(unary, float("-inf")).scatter_(-1, cand, scores)
        return full, torch.stack(drafts, 1)

    def draft_logits(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor):
        """``[g, D, V]``: the selector walk's scores (``walk``), already in the transformed space of the
        head's logits (their argmax is the walk's draft; -inf outside a slot's K candidates)."""
        return self.walk(drafter, hidden, anchors)[0]

    def candidate_hits(self, drafter: DFlashDrafter, draft_logits: torch.Tensor, greedy: torch.Tensor):
        """``[g, D]``: the target's token among the slot's K unary candidates, the finite entries of the
        walk's scores (``draft_logits``; the selector cannot draft another token)."""
        return torch.isfinite(draft_logits.gather(-1, greedy[..., None]).squeeze(-1))

    @torch.no_grad()
    def tree_expansion(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """DDTree children from the selector's distribution given the node's own token: depth j's
        children are slot j + 1's K candidates scored after that token (the anchor for the root)."""
        spec, selector = drafter.spec, drafter.candidate_selector
        unary = transform_logits(_upcast(drafter.block_logits(hidden[1:])), **spec.logit_options)  # [D, V]
        top, cand = unary.topk(selector.top_k, dim=-1)
        projected = selector.hidden_projection(hidden[1:].to(selector.predecessor_codebook.dtype))

        def step(k: int, prev: int):
            context = selector.predecessor_codebook[prev] * projected[k]
            scores = top[k] + selector.transition(context, cand[k]).to(top.dtype)
            out = torch.full_like(unary[k], float("-inf"))
            return out.scatter_(0, cand[k], torch.log_softmax(scores, -1)), None

        return step(0, anchor), lambda token, state, depth: step(depth, token)

    @torch.no_grad()
    def propose(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """The selector walk over one block's hidden ``[B, H]``: ``(log_probs [B-1, V], drafts [B-1])``,
        each slot's distribution the softmax of its K scores given the draft before it."""
        scores, drafts = self.walk(drafter, hidden[None], torch.tensor([anchor], device=hidden.device))
        return torch.log_softmax(scores[0], dim=-1), drafts[0].tolist()
