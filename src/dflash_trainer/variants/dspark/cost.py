"""DSpark's cost for the planner: the heads' parameters and the Markov bias's rank in the loss."""

from __future__ import annotations

from .settings import DSparkSettings


class DSparkCost:
    """The planner hooks of ``Variant``."""

    def head_shapes(self, s: DSparkSettings, hidden: int, vocab: int) -> list[tuple[int, ...]]:
        r = s.markov_rank
        shapes = [(vocab, r), (vocab, r)]  # W1, W2
        if s.markov_head_type == "gated":
            shapes += [(r, hidden + r), (r,)]
        elif s.markov_head_type == "rnn":
            shapes += [(3 * r, 2 * r + hidden), (3 * r,)]
        if s.confidence_head:
            shapes += [(1, hidden + (r if s.confidence_head_with_markov else 0)), (1,)]
        return shapes

    def planner_terms(self, s: DSparkSettings) -> dict:
        return {
            **super().planner_terms(s),
            "label_shift": 1 if s.sample_from_anchor else 0,
            "bias_rank": s.markov_rank,
            "per_row_terms": self.needs_teacher(s),
            "variant_teacher": self.needs_teacher(s),
        }
