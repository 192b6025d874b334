"""DFlash2 in the formats: z-lab's ``DFlash2DraftModel`` layout and speculators' ``dflash2``, both ways."""

from __future__ import annotations

from pydantic import ValidationError

from ...errors import UserError
from ...model.drafter import DrafterSpec
from .settings import DFlash2Settings

# speculators' DFlash2 config fields, by our names (the same names, z-lab's ``dflash_config`` too)
CONFIG_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


class DFlash2Formats:
    """The format hooks of ``Variant``."""

    def read_speculators_config(self, cfg: dict, where: str) -> dict:
        """The settings of a speculators ``dflash2`` config (or z-lab's ``dflash_config``); a missing field
        takes DFlash2's default; the training-only ``selector_alpha`` is the default."""
        if cfg.get("sample_from_anchor"):
            raise UserError(f"{where}: sample_from_anchor is true; a DFlash2 drafter drafts slots 1..B-1")
        given = {name: cfg[name] for name in CONFIG_FIELDS if cfg.get(name) is not None}
        try:
            return DFlash2Settings(**given).model_dump()
        except ValidationError as exc:
            err = exc.errors()[0]
            raise UserError(f"{where}: {err['loc'][0]} {err.get('input')!r}: {err['msg']}") from None

    def read_zlab_config(self, fields: dict, where: str) -> dict:
        """z-lab's ``DFlash2DraftModel`` reads all four fields with no default: each must be there."""
        missing = [name for name in CONFIG_FIELDS if fields.get(name) is None]
        if missing:
            raise UserError(
                f"{where}: a z-lab DFlash2DraftModel folder without dflash_config.{missing[0]} "
                "(z-lab's code requires conv_kernel_size, conv_group_size, selector_rank and selector_top_k)"
            )
        return self.read_speculators_config(fields, where)

    def export_refusal(self, fmt: str, spec: DrafterSpec) -> str | None:
        return None  # z-lab's layout (DFlash2DraftModel) and speculators' dflash2 both hold it

    def zlab_config(self, config: dict, spec: DrafterSpec) -> dict:
        """z-lab's ``DFlash2DraftModel`` layout: its class, and the four fields in ``dflash_config``. No
        ``auto_map``: the shipped ``modeling_dflash.py`` computes DFlash only (load it with z-lab's
        package, ``dflash.DFlash2DraftModel.from_pretrained``)."""
        o = self.settings(spec)
        rest = {k: v for k, v in config.items() if k != "auto_map"}
        dflash = {**config["dflash_config"], **{name: getattr(o, name) for name in CONFIG_FIELDS}}
        return {**rest, "architectures": ["DFlash2DraftModel"], "dflash_config": dflash}

    def speculators_config(self, config: dict, spec: DrafterSpec) -> dict:
        """speculators' ``DFlash2SpeculatorConfig``: the DFlash fields plus the convolution and selector sizes."""
        o = self.settings(spec)
        sc = dict(config["speculators_config"], algorithm="dflash2")
        return {
            **config,
            "speculators_model_type": "dflash2",
            "architectures": ["DFlash2DraftModel"],
            **{name: getattr(o, name) for name in CONFIG_FIELDS},
            "speculators_config": sc,
        }
