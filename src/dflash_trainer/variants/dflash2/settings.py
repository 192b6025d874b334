"""The ``drafter.dflash2`` section: DFlash2's typed settings (torch-free: the config reads them)."""

from __future__ import annotations

from pydantic import Field

from ...config.variants import VariantSettings


class DFlash2Settings(VariantSettings):
    """DFlash2 (z-lab, dflash 0.1.0 ``DFlash2DraftModel``; speculators' ``models/dflash2``): the DFlash
    backbone with a grouped dynamic causal convolution around attention and around the MLP of every
    layer, and a candidate selector that re-scores the head's top K tokens given the token before."""

    conv_kernel_size: int = Field(2, ge=1, description="causal taps of each local convolution (<= block_size)")
    conv_group_size: int = Field(16, ge=1, description="hidden channels sharing one dynamic kernel (divides hidden)")
    selector_rank: int = Field(256, ge=1, description="r of the selector's codebooks [V, r] and projection [r, H]")
    selector_top_k: int = Field(16, ge=1, description="K unary candidates the selector re-scores per slot")
    selector_alpha: float = Field(1.0, ge=0.0, description="weight of the selector's K-way cross-entropy")
