"""DFlash2's cost for the planner: the convolutions' and the selector's parameters, what they keep for
the backward pass, and the plan's note on the selector."""

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

    def layer_activations(
        self, s: DFlash2Settings, queries: int, hidden: int, compute_bytes: int, autocast: bool
    ) -> dict[str, int]:
        """The two convolutions of a layer (``modules._LeanConv`` keeps only its inputs): per sublayer the
        norm's output ``[Q, H]`` fp32 (the input side's input, which the projections would not otherwise
        keep) and its cast for ``kernel_projection`` under autocast, the dynamic kernels ``[Q, 2, kernel,
        G]`` and the sublayer's output ``[Q, H]`` (the output side's input)."""
        q, h, c = queries, hidden, compute_bytes
        groups = h // s.conv_group_size
        per_sublayer = q * h * 4 + (q * h * c if autocast else 0) + q * 2 * s.conv_kernel_size * groups * c + q * h * c
        return {"local convolutions": 2 * per_sublayer}

    def layer_backward_transient(self, s: DFlash2Settings, queries: int, hidden: int) -> int:
        """``_LeanConv``'s backward: the input gradient it accumulates, a product and a shifted copy
        ``[Q, H]`` (fp32), per application; the sublayer's own backward runs after it."""
        return 3 * queries * hidden * 4

    def planner_notes(self, s: DFlash2Settings, rows: int, vocab: int) -> dict[str, str]:
        return {
            "candidate selector (top-K rows)": f"top {s.selector_top_k} of {rows:,} rows; codebooks 2 x {vocab:,} x "
            f"{s.selector_rank} = {2 * vocab * s.selector_rank / 1e6:,.0f} M parameters (weights, gradients, "
            "AdamW state above)"
        }
