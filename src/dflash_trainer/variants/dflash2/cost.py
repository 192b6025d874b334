"""DFlash2's cost for the planner: the convolutions' and the selector's parameters, and the sizes its
activation formulas read."""

from __future__ import annotations

from .settings import DFlash2Settings


class DFlash2Cost:
    """The planner hooks of ``Variant``."""

    def head_shapes(self, s: DFlash2Settings, hidden: int, vocab: int) -> list[tuple[int, ...]]:
        r = s.selector_rank
        return [(vocab, r), (vocab, r), (r, hidden)]

    def layer_shapes(self, s: DFlash2Settings, hidden: int) -> list[tuple[int, ...]]:
        kernel, groups = s.conv_kernel_size, hidden // s.conv_group_size
        conv = [(2, kernel, hidden), (2 * kernel * groups, hidden)]
        return conv + conv  # around attention, around the MLP

    def loss_activations(self, s: DFlash2Settings, rows: int, hidden: int, autocast: bool) -> dict[str, int]:
        """The selector loss on the ``n`` loss rows (``objective.selector_loss``): the top-K ids and
        training candidates ``[n, K]`` int64, the candidates' unary logits and scores ``[n, K]`` fp32, the
        predecessor rows and the projected hidden ``[n, r]`` fp32, and the successor rows ``[n, K, r]``
        fp32 with their autocast cast (the einsum keeps the cast for backward)."""
        n, k, r = rows, s.selector_top_k, s.selector_rank
        kept = 2 * n * k * 8 + 3 * n * k * 4 + 2 * n * r * 4 + n * k * r * (4 + (2 if autocast else 0))
        return {"candidate selector (top-K rows)": kept}

    def planner_terms(self, s: DFlash2Settings) -> dict:
        return {
            **super().planner_terms(s),
            "conv_kernel": s.conv_kernel_size,
            "conv_group_size": s.conv_group_size,
            "selector_rank": s.selector_rank,
            "selector_top_k": s.selector_top_k,
        }
