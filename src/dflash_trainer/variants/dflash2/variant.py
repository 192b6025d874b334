"""DFlash2 as a ``Variant``: its settings, convolutions and selector, with the objective, drafting,
format and cost hooks of this package's modules."""

from __future__ import annotations

from torch import nn

from ...errors import UserError
from ...model.drafter import DrafterSpec
from ..base import Variant
from .cost import DFlash2Cost
from .drafting import DFlash2Drafting
from .formats import CODEBOOKS, CONFIG_FIELDS, DFlash2Formats
from .modules import CandidateSelector, GroupedDynamicCausalConv
from .objective import DFlash2Objective
from .settings import DFlash2Settings


class DFlash2Variant(DFlash2Objective, DFlash2Drafting, DFlash2Formats, DFlash2Cost, Variant):
    name = "dflash2"
    settings_type = DFlash2Settings
    speculators_type = "dflash2"
    speculators_non_causal_default = True  # DFlash2SpeculatorConfig's default (DFlash's is false)
    head_names = ("candidate_selector",)
    vocabulary_tables = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
    logged_metrics = ("selector_ce", "candidate_recall", "selector_accuracy")
    zlab_architecture = "DFlash2DraftModel"
    zlab_fields = CONFIG_FIELDS
    # z-lab's own save_pretrained writes its codebooks as nn.Embedding weights; speculators' (and this
    # project's export) as plain parameters, which z-lab's from_pretrained maps onto its embeddings
    key_aliases = {f"candidate_selector.{n}.weight": f"candidate_selector.{n}" for n in CODEBOOKS}

    def _check(self, spec: DrafterSpec) -> DFlash2Settings:
        o = self.settings(spec)
        if spec.hidden_size % o.conv_group_size:
            raise UserError(
                f"drafter.dflash2.conv_group_size {o.conv_group_size} must divide the hidden size {spec.hidden_size}"
            )
        if o.conv_kernel_size > spec.block_size:
            raise UserError(
                f"drafter.dflash2.conv_kernel_size {o.conv_kernel_size} exceeds the block size {spec.block_size}"
            )
        if o.selector_top_k > spec.vocab_size:
            raise UserError(
                f"drafter.dflash2.selector_top_k {o.selector_top_k} exceeds the vocabulary ({spec.vocab_size})"
            )
        return o

    def layer_modules(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        o = self._check(spec)
        make = lambda: GroupedDynamicCausalConv(  # noqa: E731
            spec.hidden_size, spec.block_size, o.conv_kernel_size, o.conv_group_size
        )
        return {"attention_conv": make(), "mlp_conv": make()}

    def heads(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        o = self._check(spec)
        return {
            "candidate_selector": CandidateSelector(
                spec.vocab_size, spec.hidden_size, o.selector_rank, o.selector_top_k
            )
        }
