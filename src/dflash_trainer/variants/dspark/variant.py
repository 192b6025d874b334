"""DSpark as a ``Variant``: its settings, heads and label shift, with the objective, drafting, format
and cost hooks of this package's modules."""

from __future__ import annotations

from torch import nn

from ...model.drafter import DrafterSpec
from ..base import Variant
from .cost import DSparkCost
from .drafting import DSparkDrafting
from .formats import DSparkFormats
from .modules import ConfidenceHead, MarkovHead
from .objective import DSparkObjective
from .settings import DSparkSettings


class DSparkVariant(DSparkObjective, DSparkDrafting, DSparkFormats, DSparkCost, Variant):
    name = "dspark"
    settings_type = DSparkSettings
    speculators_type = "dspark"
    zlab_architecture = None  # z-lab's layout has no Markov or confidence head
    head_names = ("markov_head", "confidence_head")
    vocabulary_tables = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")

    def label_shift(self, spec: DrafterSpec) -> int:
        return self.settings(spec).label_shift

    def heads(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        o = self.settings(spec)
        out = {"markov_head": MarkovHead(spec.vocab_size, o.markov_rank, spec.hidden_size, o.markov_head_type)}
        if o.confidence_head:
            extra = o.markov_rank if o.confidence_head_with_markov else 0
            out["confidence_head"] = ConfidenceHead(spec.hidden_size + extra)
        return out
