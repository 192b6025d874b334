"""A drafter variant defined outside ``src/`` (issue 36's proof that a variant is a package plus one
``register`` call): no file under ``src/`` names it. ``tests/test_variant_contract.py`` registers it
for its own tests only (``variants.register``, then ``unregister``: the run.yaml files written while
it is registered hold its section, which other processes would refuse) and runs it through the same
checks as the built-in variants.

``lookback``: the DFlash backbone plus a low-rank residual adapter on the drafter's hidden state before
the shared head, ``h' = h + U (D h)`` (``D`` ``[r, H]``, ``U`` ``[H, r]``, U zero-initialized so an
untrained lookback drafter drafts exactly as DFlash). Its loss adds a row term of its own, the
Renyi-1/2 divergence to the teacher at weight ``agreement_weight`` (a ``PairTerm``: the kernels compute
it without knowing the variant); it drafts the adapted logits' argmax; the planner prices the adapter's
parameters and what it keeps for the backward pass; no export format holds the adapter, so every
export is refused in one line.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from pydantic import Field
from torch import nn

from dflash_trainer.config.variants import VariantSettings
from dflash_trainer.loss import PairTerm
from dflash_trainer.loss.logits import transform_logits
from dflash_trainer.variants.base import Variant

NAME = "lookback"


class LookbackSettings(VariantSettings):
    rank: int = Field(4, ge=1, description="r of the adapter H -> r -> H")
    agreement_weight: float = Field(0.1, ge=0.0, description="weight of the Renyi-1/2 row term")


class LookbackAdapter(nn.Module):
    """``down`` (H -> r) and ``up`` (r -> H, zero at init): ``h + up(down(h))``."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(self.down(hidden.to(self.down.weight.dtype))).to(hidden.dtype)


class LookbackVariant(Variant):
    name = NAME
    settings_type = LookbackSettings
    speculators_type = None  # no speculators layout holds the adapter
    zlab_architecture = None
    head_names = ("lookback_adapter",)
    logged_metrics = ("agreement",)  # its row term's mean, in metrics.jsonl

    def heads(self, spec):
        return {"lookback_adapter": LookbackAdapter(spec.hidden_size, self.settings(spec).rank)}

    # cost
    def head_shapes(self, s, hidden, vocab):
        return [(s.rank, hidden), (hidden, s.rank)]

    def loss_activations(self, s, rows, hidden, autocast):
        return {"lookback adapter (down and adapted rows)": rows * (s.rank + hidden) * 4}

    def planner_terms(self, s):
        return {**super().planner_terms(s), "per_row_terms": s.agreement_weight > 0}

    # objective
    def needs_teacher(self, s) -> bool:
        return s.agreement_weight > 0

    def loss(self, drafter, hidden, teacher, head, batch, terms, options, *, reference):
        s = self.settings(drafter.spec)
        if s.agreement_weight > 0:
            own = PairTerm("agreement", "renyi_half", weight=s.agreement_weight)
            terms = replace(terms, pair_terms=(own, *terms.pair_terms))
        adapted = drafter.lookback_adapter(hidden)
        return self.draft_loss(drafter, adapted, teacher, head, batch, terms, options, reference=reference)

    # drafting
    def draft_logits(self, drafter, hidden, anchors, greedy):
        head = drafter.lm_head_weight
        return drafter.lookback_adapter(hidden[:, 1:]).to(head.dtype) @ head.T

    @torch.no_grad()
    def propose(self, drafter, hidden, anchor):
        adapted = drafter.lookback_adapter(hidden[1:])
        logits = transform_logits(drafter.block_logits(adapted).float(), **drafter.spec.logit_options)
        log_probs = torch.log_softmax(logits, dim=-1)
        return log_probs, log_probs.argmax(-1).tolist()

    # formats
    def export_refusal(self, fmt, spec):
        return f"the {fmt} format has no lookback adapter: a lookback drafter stays a checkpoint"
