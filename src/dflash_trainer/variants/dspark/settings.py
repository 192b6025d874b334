"""The ``drafter.dspark`` section: DSpark's typed settings (torch-free: the config reads them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...config.variants import VariantSettings


class DSparkSettings(VariantSettings):
    """DSpark (DeepSeek, arXiv 2607.05147; speculators' ``models/dspark``): the DFlash backbone plus a
    low-rank Markov logit bias from the previous block token and a confidence head."""

    markov_rank: int = Field(256, ge=1, description="r of the Markov bias W2 @ W1[prev] (W1, W2: [V, r])")
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        "vanilla",
        description="vanilla: W2 W1[prev]; gated: sigmoid gate from [hidden, W1[prev]]; rnn: a state over the block",
    )
    sample_from_anchor: bool = Field(
        True,
        description="the anchor slot predicts too: slot k predicts the token at anchor + k + 1 (B tokens a "
        "block); false: slot k predicts anchor + k as in DFlash (B - 1 tokens)",
    )
    confidence_head: bool = Field(True, description="a linear head predicting each slot's acceptance")
    confidence_head_with_markov: bool = Field(True, description="the confidence head also reads W1[prev]")
    confidence_alpha: float = Field(1.0, ge=0.0, description="weight of the confidence head's BCE")
    renyi_weight: float = Field(0.0, ge=0.0, description="weight of the Renyi-1/2 term -2 log sum sqrt(p q)")
    position_weights: Literal["decay", "dpard"] = Field(
        "decay", description="slot weights: the fixed exp decay (loss.gamma) or the D-PARD credit"
    )
    dpard_alpha: float = Field(0.5, gt=0.0, le=1.0, description="s_i = alpha + (1 - alpha) a_i of D-PARD")

    @property
    def label_shift(self) -> int:
        return 1 if self.sample_from_anchor else 0

    @property
    def block_credit(self) -> str | None:
        return "position_weights=dpard" if self.position_weights == "dpard" else None
