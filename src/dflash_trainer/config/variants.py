"""What the config knows of drafter variants: the base of their settings, and which are registered.

A variant registers itself (``dflash_trainer.variants.register``) with a ``VariantSettings`` subclass;
a subclass with fields becomes the section ``drafter.<variant>``, so ``--set
drafter.dspark.markov_rank=64`` is checked like every other key (``schema.add_variant_section``).
The settings are typed and torch-free: the config answers without importing a variant's code.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class VariantSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @property
    def label_shift(self) -> int:
        """Slot k of a block predicts the token at ``anchor + k + label_shift`` (DFlash: 0): the one thing
        the shared data path asks of a variant's settings."""
        return 0

    @property
    def block_credit(self) -> str | None:
        """The setting (``key=value``) by which these settings replace the slot weights with a block
        credit, or None: ``loss.position_weights=dpace`` does that too, and the two exclude each other."""
        return None
