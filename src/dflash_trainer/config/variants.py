"""The settings of each drafter variant other than DFlash (``drafter.variant``).

A variant's settings live in its own section, ``drafter.<variant>``, so ``--set drafter.dspark.markov_rank=64``
is checked like every other key. ``label_shift`` is the one thing the shared data path asks of a
variant's settings: slot k of a block predicts the token at ``anchor + k + label_shift`` (DFlash: 0).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VariantSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @property
    def label_shift(self) -> int:
        return 0


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


class DFlash2Settings(VariantSettings):
    """DFlash2 (z-lab, dflash 0.1.0 ``DFlash2DraftModel``; speculators' ``models/dflash2``): the DFlash
    backbone with a grouped dynamic causal convolution around attention and around the MLP of every
    layer, and a candidate selector that re-scores the head's top K tokens given the token before."""

    conv_kernel_size: int = Field(2, ge=1, description="causal taps of each local convolution (<= block_size)")
    conv_group_size: int = Field(16, ge=1, description="hidden channels sharing one dynamic kernel (divides hidden)")
    selector_rank: int = Field(256, ge=1, description="r of the selector's codebooks [V, r] and projection [r, H]")
    selector_top_k: int = Field(16, ge=1, description="K unary candidates the selector re-scores per slot")
    selector_alpha: float = Field(1.0, ge=0.0, description="weight of the selector's K-way cross-entropy")
