"""Drafter variants: what a variant adds to the shared DFlash backbone, one module each.

A variant (``base.Variant``) says which token each block slot predicts (``label_shift``), which heads
it adds to the drafter, what it adds to the loss, how it drafts a block at inference, and how its
heads export. The backbone, data path, trainer, distributed training, checkpoints and the planner
call these hooks and never branch on the variant's name. Adding a variant: its module here, its
settings in ``config/variants.py``, and one line in ``VARIANTS``.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.drafter import DFlashDrafter, DrafterSpec
from .base import Variant
from .dflash2 import DFlash2Variant
from .dspark import DSparkVariant

VARIANTS: dict[str, Variant] = {"dflash": Variant(), "dspark": DSparkVariant(), "dflash2": DFlash2Variant()}


def variant_of(spec: DrafterSpec | str) -> Variant:
    """The variant of a drafter spec (or by name)."""
    name = spec if isinstance(spec, str) else spec.variant
    if name not in VARIANTS:
        raise UserError(f"unknown drafter variant {name!r}: this dflash-trainer knows {sorted(VARIANTS)}")
    return VARIANTS[name]


def block_span(spec: DrafterSpec) -> int:
    """Row tokens a block covers: B plus the variant's label shift; a block proposes ``span - 1`` drafts."""
    return spec.block_size + variant_of(spec).label_shift(spec)


def make_drafter(spec: DrafterSpec, embed_tokens, lm_head_weight) -> DFlashDrafter:
    """The drafter of ``spec``: the shared backbone plus its variant's heads (registered submodules,
    so they are parameters, in the state dict, checkpoints and the optimizer like the backbone)."""
    variant = variant_of(spec)
    drafter = DFlashDrafter(spec, embed_tokens, lm_head_weight)
    for layer in drafter.layers:
        for name, module in variant.layer_modules(spec).items():
            layer.add_module(name, module)
    for name, module in variant.heads(spec).items():
        drafter.add_module(name, module)
    return drafter


__all__ = ["VARIANTS", "Variant", "block_span", "make_drafter", "variant_of"]
