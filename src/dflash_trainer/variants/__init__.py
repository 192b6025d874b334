"""Drafter variants: what a variant adds to the shared DFlash backbone, one package each, registered here.

A variant (``base.Variant``) says which token each block slot predicts (``label_shift``), which heads
it adds to the drafter, what it adds to the loss, how it drafts a block at inference, how its heads
export and what they cost the planner. The backbone, data path, trainer, distributed training,
checkpoints, exports and the planner call these hooks and never name a variant.

Adding a variant: a package ``variants/<name>/`` (``settings``, ``modules``, ``objective``,
``drafting``, ``formats``, ``cost``, and ``variant`` putting them together, as ``dspark/``) and one
``register`` call below; a variant defined elsewhere calls ``register`` itself (``tests/
probe_variant.py`` does, with no file under ``src/`` naming it). Registering makes
``drafter.variant=<name>`` valid and its settings the typed section ``drafter.<name>``.

This module is torch-free: a variant's settings load with the config, its code on first use
(``variant_of``), so ``dflash-train config`` answers without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config.schema import VARIANT_SETTINGS, add_variant_section, remove_variant_section
from ..config.variants import VariantSettings
from ..errors import UserError
from .dflash2.settings import DFlash2Settings
from .dspark.settings import DSparkSettings

if TYPE_CHECKING:
    from ..model.drafter import DFlashDrafter, DrafterSpec
    from .base import Variant

_BUILDERS: dict[str, Callable[[], Variant]] = {}  # name -> what builds the variant (its class will do)
_BUILT: dict[str, Variant] = {}


def register(name: str, settings: type[VariantSettings], build: Callable[[], Variant]) -> None:
    """Register variant ``name``: ``settings`` its typed settings (a ``VariantSettings`` subclass; one
    with fields becomes the section ``drafter.<name>``), ``build`` its ``Variant`` subclass or a function
    returning the variant, called on first use. A name registered again with other settings is refused."""
    if not (isinstance(settings, type) and issubclass(settings, VariantSettings)):
        raise TypeError(f"variant {name!r}: settings must be a VariantSettings subclass, got {settings!r}")
    add_variant_section(name, settings)
    _BUILDERS.setdefault(name, build)


def unregister(name: str) -> None:
    """Remove a registered variant and its config section (a variant registered for a while, as a
    test's: a ``run.yaml`` written meanwhile holds its section, which other processes do not know)."""
    if name == "dflash":
        raise ValueError("dflash, the backbone's own variant, stays registered")
    _BUILDERS.pop(name, None)
    _BUILT.pop(name, None)
    remove_variant_section(name)


def variant_of(spec: DrafterSpec | str) -> Variant:
    """The variant of a drafter spec (or by name)."""
    name = spec if isinstance(spec, str) else spec.variant
    if name not in _BUILDERS:
        raise UserError(f"unknown drafter variant {name!r}: this dflash-trainer knows {sorted(_BUILDERS)}")
    if name not in _BUILT:
        variant = _BUILDERS[name]()
        if variant.name != name or variant.settings_type is not VARIANT_SETTINGS[name]:
            raise TypeError(f"variant {name!r}: its code's name or settings differ from its registration")
        _BUILT[name] = variant
    return _BUILT[name]


def registered() -> list[Variant]:
    """Every registered variant, in registration order (their code imported)."""
    return [variant_of(name) for name in list(_BUILDERS)]


def block_span(spec: DrafterSpec) -> int:
    """Row tokens a block covers: B plus the variant's label shift; a block proposes ``span - 1`` drafts."""
    return spec.block_size + variant_of(spec).label_shift(spec)


def make_drafter(spec: DrafterSpec, embed_tokens, lm_head_weight) -> DFlashDrafter:
    """The drafter of ``spec``: the shared backbone plus its variant's heads (registered submodules,
    so they are parameters, in the state dict, checkpoints and the optimizer like the backbone)."""
    from ..model.drafter import DFlashDrafter

    variant = variant_of(spec)
    drafter = DFlashDrafter(spec, embed_tokens, lm_head_weight)
    for layer in drafter.layers:
        for name, module in variant.layer_modules(spec).items():
            layer.add_module(name, module)
    for name, module in variant.heads(spec).items():
        drafter.add_module(name, module)
    return drafter


def _dflash() -> Variant:
    from .base import Variant

    return Variant()


def _dspark() -> Variant:
    from .dspark.variant import DSparkVariant

    return DSparkVariant()


def _dflash2() -> Variant:
    from .dflash2.variant import DFlash2Variant

    return DFlash2Variant()


# The built-in variants, in the order of their sections in a run's config
register("dflash", VariantSettings, _dflash)
register("dspark", DSparkSettings, _dspark)
register("dflash2", DFlash2Settings, _dflash2)

__all__ = ["block_span", "make_drafter", "register", "registered", "unregister", "variant_of"]
