"""DSpark's drafting: the Markov walk over a block (one drafter pass, only the heads walk), the
confidence head's early stop, and DDTree children conditioned on each node's own token."""

from __future__ import annotations

import torch

from ...loss.logits import transform_logits
from ...model.drafter import DFlashDrafter


class DSparkDrafting:
    """The drafting hooks of ``Variant``."""

    def draft_logits(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor):
        """``[g, D, V]``: the Markov walk's logits, each slot biased by the walk's own (argmax) draft
        before it, the anchor for the first: exactly what ``propose`` drafts. Teacher-forced chain
        acceptance is the same as conditioning on the target's greedy tokens (the chain stops at the
        first mismatch), and the sampled chain is the drafts decoding really verifies."""
        return self.walk(drafter, hidden, anchors)[0]

    def draft_logits_and_confidence(
        self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor
    ):
        """The Markov walk's logits (``draft_logits``) and the confidence head's sigmoid along it (None
        without the head), from one walk (two cost eval 1.9 CPU-s against 1.4 on one test drafter)."""
        logits, _, confidence = self.walk(drafter, hidden, anchors)
        return logits, confidence

    @torch.no_grad()
    def walk(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor):
        """Blocks ``hidden`` ``[g, B, H]`` with anchor tokens ``[g]`` -> (raw logits ``[g, D, V]``, drafts
        ``[g, D]``, confidence ``[g, D]`` or None): slot by slot, only the heads walk.

        The head's part of every slot's logits, ``hidden[:, k] @ W^T``, does not depend on the walk: one
        ``[g D, H] @ [H, V]`` GEMM gives all of them, reading W once instead of once per slot (decoding,
        g = 1: D GEMVs each streaming the whole head took 2.8 ms against 0.9 ms for one GEMM, D = 8,
        H = 256, V = 8192, one thread); the walk adds each slot's Markov bias in place."""
        spec, head, w_head = drafter.spec, drafter.markov_head, drafter.lm_head_weight
        g, b, _ = hidden.shape
        shift = self.label_shift(spec)
        first = 1 - shift  # slot 0 without sample_from_anchor: no draft (it only advances the rnn state)
        logits = drafter.block_logits(hidden[:, first:])  # [g, D, V]: one flattened GEMM
        seq = [anchors.long()]  # tokens at anchor + 0, 1, ...
        state = hidden.new_zeros(g, head.rank, dtype=head.markov_w1.weight.dtype)
        confs = []
        with_markov = self.settings(spec).confidence_head_with_markov
        for k in range(b):
            emb = head.markov_w1(seq[max(0, k + shift - 1)])  # [g, r]
            h = hidden[:, k].to(emb.dtype)
            if head.head_type == "vanilla":
                feat = emb
            elif head.head_type == "gated":
                feat = torch.sigmoid(head.gate_proj(torch.cat([h, emb], dim=-1))) * emb
            else:
                feat, state = head._rnn_step(state, emb, h)
            if k < first:
                continue
            z = logits[:, k - first]
            z += (feat @ head.markov_w2.weight.T).to(w_head.dtype)  # the Markov bias of the draft before
            seq.append(z.argmax(-1))
            if hasattr(drafter, "confidence_head"):
                confs.append(torch.sigmoid(drafter.confidence_head(torch.cat([h, emb], -1) if with_markov else h)))
        conf = torch.stack(confs, 1) if confs else None
        return logits, torch.stack(seq[1:], 1), conf

    @torch.no_grad()
    def tree_expansion(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """DDTree children from the distribution conditioned on the node's own token: depth j's draft is
        slot ``j - shift``'s head logits plus the Markov bias of the token at depth j - 1 (the anchor at
        depth 1); the rnn head's state follows the node's path."""
        spec, head, w_head = drafter.spec, drafter.markov_head, drafter.lm_head_weight
        shift = self.label_shift(spec)
        first = 1 - shift
        # hidden[k] @ W^T [V]: the same for every node at depth k, so one GEMM for every drafting slot (the
        # GEMM ``walk`` runs for one block)
        slot_logits = drafter.block_logits(hidden[first:])  # [D, V]

        def step(k: int, prev: int, state):
            emb = head.markov_w1.weight[prev]
            h = hidden[k].to(emb.dtype)
            if head.head_type == "vanilla":
                feat = emb
            elif head.head_type == "gated":
                feat = torch.sigmoid(head.gate_proj(torch.cat([h, emb]))) * emb
            else:
                feat, state = head._rnn_step(state, emb, h)
            if k < first:  # slot 0 without sample_from_anchor: it only advances the rnn state
                return None, state
            raw = slot_logits[k - first] + (head.markov_w2.weight @ feat).to(w_head.dtype)
            return torch.log_softmax(transform_logits(raw.float(), **spec.logit_options), dim=-1), state

        state = hidden.new_zeros(head.rank, dtype=head.markov_w1.weight.dtype)
        if shift == 0:  # slot 0 drafts nothing; it only advances the rnn state (prev = the anchor)
            _, state = step(0, anchor, state)
        root = step(1 - shift, anchor, state)

        def expand(token: int, state, depth: int):
            return step(depth + 1 - shift, token, state)  # the children of a node at ``depth``

        return root, expand

    @torch.no_grad()
    def propose(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int, confidence_threshold: float = 0.0):
        """The Markov walk over one block's hidden ``[B, H]``: ``(log_probs [D, V], drafts [D])``, D = B
        (sample_from_anchor) or B - 1, each row conditioned on the greedy drafts before it. With
        ``confidence_threshold`` > 0 the chain stops before the first slot at which the confidence
        head's cumulative predicted acceptance falls below it (at least one draft is kept)."""
        anchors = torch.tensor([anchor], device=hidden.device)
        logits, drafts, conf = self.walk(drafter, hidden[None], anchors)
        log_probs = torch.log_softmax(transform_logits(logits[0].float(), **drafter.spec.logit_options), dim=-1)
        drafts = drafts[0].tolist()
        if confidence_threshold > 0 and conf is not None:
            below = (torch.cumprod(conf[0].double(), 0) < confidence_threshold).nonzero()
            keep = max(1, int(below[0]) if below.numel() else len(drafts))
            log_probs, drafts = log_probs[:keep], drafts[:keep]
        return log_probs, drafts
