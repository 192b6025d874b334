"""DSpark in the formats: speculators' ``dspark`` layout (the one that holds its heads) both ways."""

from __future__ import annotations

from pydantic import ValidationError

from ...errors import UserError
from ...model.drafter import DrafterSpec
from .settings import DSparkSettings


class DSparkFormats:
    """The format hooks of ``Variant``."""

    def read_speculators_config(self, cfg: dict, where: str) -> dict:
        """The heads' settings of a speculators ``dspark`` config (``speculators_config`` above); a
        missing field takes DSpark's default. Training-only settings (loss weights) are DSpark's defaults."""
        fields = {
            "markov_rank": "markov_rank",
            "markov_head_type": "markov_head_type",
            "sample_from_anchor": "sample_from_anchor",
            "confidence_head": "enable_confidence_head",
            "confidence_head_with_markov": "confidence_head_with_markov",
        }
        given = {ours: cfg[theirs] for ours, theirs in fields.items() if cfg.get(theirs) is not None}
        try:
            return DSparkSettings(**given).model_dump()
        except ValidationError as exc:
            err = exc.errors()[0]
            name = fields.get(str(err["loc"][0]), err["loc"][0])
            raise UserError(f"{where}: {name} {err.get('input')!r}: {err['msg']}") from None

    def export_refusal(self, fmt: str, spec: DrafterSpec) -> str | None:
        if fmt != "speculators":
            return f"the {fmt} format has no Markov or confidence head: export a dspark drafter as speculators"
        return None

    def speculators_config(self, config: dict, spec: DrafterSpec) -> dict:
        """speculators' ``DSparkSpeculatorConfig`` (the ``dspark`` method vLLM serves): the DFlash fields
        plus the heads' settings; the weights keep speculators' names (``markov_head.markov_w1`` ...)."""
        o = self.settings(spec)
        drafts = spec.block_size if o.sample_from_anchor else spec.block_size - 1
        sc = dict(config["speculators_config"], algorithm="dspark")
        sc["proposal_methods"] = [{"proposal_type": "greedy", "speculative_tokens": drafts}]
        return {
            **config,
            "speculators_model_type": "dspark",
            "architectures": ["DSparkSpeculator"],
            "sample_from_anchor": o.sample_from_anchor,
            "markov_rank": o.markov_rank,
            "markov_head_type": o.markov_head_type,
            "enable_confidence_head": o.confidence_head,
            "confidence_head_with_markov": o.confidence_head_with_markov and o.confidence_head,
            "speculators_config": sc,
        }
