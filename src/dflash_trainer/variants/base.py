"""The variant interface, with DFlash's behaviour as its defaults.

DFlash: slot k of a block ``[anchor, MASK x (B-1)]`` predicts the token at ``anchor + k`` (k >= 1),
no heads beyond the backbone, the fused loss of ``loss/``, and B - 1 drafts read off the block's
logits at once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.variants import VariantSettings
from ..errors import UserError
from ..loss import LossTerms, fused_draft_loss, reference_draft_loss
from ..loss.logits import transform_logits
from ..model.drafter import DFlashDrafter, DrafterSpec


class Variant:
    name = "dflash"
    settings_type: type[VariantSettings] = VariantSettings  # its ``drafter.<name>`` section (none without fields)
    speculators_type: str | None = "dflash"  # the ``speculators_model_type`` of its speculators export (None: none)
    head_names: tuple[str, ...] = ()  # attribute names ``heads`` may add (their tensors' name prefixes)
    logged_metrics: tuple[str, ...] = ()  # scalar metrics of ``loss`` the trainer logs each step (metrics.jsonl)
    # parameter names of the variant's vocabulary-sized tables (embeddings, codebooks, a vocabulary
    # head): train.optimizer=muon keeps them on AdamW, as Muon's authors keep embeddings and heads
    vocabulary_tables: tuple[str, ...] = ()
    # speculators' config default of ``sliding_window_non_causal`` for this ``speculators_type``
    speculators_non_causal_default = False
    # z-lab's layout: the class of z-lab's package that loads it (None: the layout cannot hold the
    # variant), and the ``dflash_config`` fields that mark a folder as this variant's
    zlab_architecture: str | None = "DFlashDraftModel"
    zlab_fields: tuple[str, ...] = ()
    # tensor names other writers use for this variant's tensors -> this project's names
    key_aliases: dict[str, str] = {}

    def read_speculators_config(self, cfg: dict, where: str) -> dict:
        """The variant options (``DrafterSpec.variant_options``) of a speculators ``config.json`` of this
        variant's ``speculators_type``, whoever wrote it; ``UserError`` (one line) for what it cannot hold."""
        if cfg.get("sample_from_anchor"):
            raise UserError(
                f"{where}: sample_from_anchor is true (slot 0 drafts too); a DFlash drafter drafts slots 1..B-1"
            )
        return {}

    def read_zlab_config(self, fields: dict, where: str) -> dict:
        """The variant options of a z-lab folder, from its ``zlab_fields`` (``fields``: each read as
        z-lab's code reads it, ``dflash_config`` first, then the top level; None where absent)."""
        return {}

    def settings(self, spec: DrafterSpec | dict) -> VariantSettings:
        """The typed settings of a drafter ``spec`` (or of its ``variant_options`` dict, the form a
        drafter's config file stores)."""
        return self.settings_type(**(spec if isinstance(spec, dict) else spec.variant_options))

    def label_shift(self, spec: DrafterSpec) -> int:
        """Slot k predicts the token at ``anchor + k + label_shift``; a block spans B + shift row tokens."""
        return self.settings(spec).label_shift

    def heads(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        """Submodules the variant adds to the drafter, by attribute name."""
        return {}

    def layer_modules(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        """Submodules the variant adds to each decoder layer, by attribute name (``DrafterLayer``'s
        sublayer wraps ``attention_conv`` / ``mlp_conv``); called once per layer."""
        return {}

    def needs_teacher(self, settings: VariantSettings) -> bool:
        """Whether the variant's loss (with ``settings``) reads the teacher even when the base loss does not."""
        return False

    def head_shapes(self, settings: VariantSettings, hidden: int, vocab: int) -> list[tuple[int, ...]]:
        """The parameter shapes ``heads`` adds (the planner prices them, their gradients and AdamW state)."""
        return []

    def layer_shapes(self, settings: VariantSettings, hidden: int) -> list[tuple[int, ...]]:
        """The parameter shapes ``layer_modules`` adds to each decoder layer (priced like ``head_shapes``)."""
        return []

    def layer_activations(
        self, settings: VariantSettings, queries: int, hidden: int, compute_bytes: int, autocast: bool
    ) -> dict[str, int]:
        """Bytes the variant's ``layer_modules`` save for the backward pass in one decoder layer of a step
        of ``queries`` block rows (``compute_bytes`` per element of the compute dtype), by item name."""
        return {}

    def layer_backward_transient(self, settings: VariantSettings, queries: int, hidden: int) -> int:
        """Temporaries the variant's ``layer_modules`` add to one layer's backward pass."""
        return 0

    def planner_notes(self, settings: VariantSettings, rows: int, vocab: int) -> dict[str, str]:
        """The plan's notes on the items the variant prices, by item name."""
        return {}

    def loss_activations(self, settings: VariantSettings, rows: int, hidden: int, autocast: bool) -> dict[str, int]:
        """Bytes the variant's heads keep alive through the loss phase of a step of ``rows`` loss rows
        (hidden size ``hidden``; ``autocast``: bf16 compute over fp32 weights), by the planner's item name."""
        return {}

    def planner_terms(self, settings: VariantSettings) -> dict:
        """The planner's ``Workload`` fields of this variant (``planner.formulas.Workload``)."""
        return {
            "variant": self.name,
            "variant_options": tuple(sorted(settings.model_dump().items())),
            "label_shift": 0,
            "bias_rank": 0,
            "per_row_terms": False,
            "variant_teacher": self.needs_teacher(settings),
        }

    def export_refusal(self, fmt: str, spec: DrafterSpec) -> str | None:
        """One line saying why ``fmt`` cannot hold this variant's drafter, or None."""
        return None

    def speculators_config(self, config: dict, spec: DrafterSpec) -> dict:
        """The speculators ``config.json`` of a DFlash export, adapted to the variant."""
        return config

    def zlab_config(self, config: dict, spec: DrafterSpec) -> dict:
        """The z-lab ``config.json`` of a DFlash export, adapted to the variant (the export ships
        ``modeling_dflash.py`` only where the config keeps its ``auto_map``)."""
        return config

    def batch_extras(self, spec: DrafterSpec, input_ids: torch.Tensor, anchors: torch.Tensor) -> dict:
        """Per-row tensors of a step's blocks the variant's loss needs (``anchors`` ``[nb]``, ``input_ids`` ``[L]``)."""
        return {}

    def loss(
        self, drafter: DFlashDrafter, hidden, teacher, head, batch, terms: LossTerms, options: dict, *, reference: bool
    ):
        """``(loss, metrics)`` of one row's blocks. ``hidden``/``teacher`` ``[N, H]`` and ``head`` ``[V, H]`` in
        the loss's dtype; ``terms`` the run's loss terms (``loss.LossTerms``), which a variant extends;
        ``options`` the call's other keywords of ``fused_draft_loss`` (``chunk_size``)."""
        return self.draft_loss(drafter, hidden, teacher, head, batch, terms, options, reference=reference)

    @staticmethod
    def draft_loss(drafter, hidden, teacher, head, batch, terms: LossTerms, options: dict, *, reference: bool, **data):
        """The fused draft loss (or its plain reference) of ``batch``'s rows with ``terms``, ``options`` and a
        variant's ``data`` keywords of ``fused_draft_loss`` (DSpark's low-rank bias). A block credit
        (``terms.credit``: D-PACE, D-PARD) gets the rows' block ids here, for whichever terms set it."""
        weights = batch.weights.to(head.dtype)
        data = {**options, **data}
        chunk_size = data.pop("chunk_size", None)
        if terms.credit is not None:  # the credit replaces the slot weights (which keep the rows)
            data["block_ids"] = torch.arange(hidden.shape[0], device=hidden.device) // drafter.spec.block_size
        if reference:
            return reference_draft_loss(hidden, teacher, head, batch.labels, weights, terms, **data)
        return fused_draft_loss(
            hidden,
            teacher,
            head,
            batch.labels,
            weights,
            terms,
            slot_ids=batch.slots,
            num_slots=drafter.spec.block_size,
            chunk_size=chunk_size,
            **data,
        )

    def tree_expansion(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """For drafts that depend on earlier drafts: ``(root, expand)`` with ``root = (log_probs [V], state)``
        of depth 1 and ``expand(token, state, depth) -> (log_probs [V], state)`` of a node's children
        (``inference.ddtree.build_conditioned_tree``). None (DFlash): the slots are independent and the
        tree is the best prefixes under the product of ``propose``'s per-slot log-probabilities."""
        return None

    def draft_logits(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor):
        """Teacher-forced raw head logits ``[g, D, V]`` of the draft slots of blocks ``hidden`` ``[g, B, H]``
        (``anchors`` ``[g]`` their anchor tokens, ``greedy`` ``[g, D]`` the target's greedy tokens)."""
        return drafter.block_logits(hidden[:, 1:])

    def draft_logits_and_confidence(
        self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor
    ):
        """What eval reads for every group of blocks: ``draft_logits`` and the ``[g, D]`` predicted
        acceptance of each draft slot along those drafts (a confidence head's), or None as the second:
        DFlash has no such head. A variant with one (DSpark) overrides this to get both from one walk."""
        return self.draft_logits(drafter, hidden, anchors, greedy), None

    def candidate_hits(self, drafter: DFlashDrafter, draft_logits: torch.Tensor, greedy: torch.Tensor):
        """``[g, D]`` bool: whether each slot's target token (``greedy`` ``[g, D]``) is among the tokens the
        variant can draft there (DFlash2's unary top K), from ``draft_logits`` ``[g, D, V]``; None: any token."""
        return None

    @torch.no_grad()
    def propose(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """One block's proposal from its hidden ``[B, H]``: ``(log_probs [D, V], greedy drafts [D])``, D the
        number of draft tokens (DFlash: slots 1..B-1, whose distributions do not depend on each other)."""
        logits = transform_logits(drafter.block_logits(hidden[1:]).float(), **drafter.spec.logit_options)
        log_probs = torch.log_softmax(logits, dim=-1)
        return log_probs, log_probs.argmax(-1).tolist()
