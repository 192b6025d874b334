"""``drafter.init_from``: start training from a drafter folder's weights (fine-tuning a published
drafter for a domain or a fine-tuned target) instead of a random init.

Any folder ``eval`` reads will do (``export.layouts.load_any_drafter``: this project's checkpoint or
export, z-lab's layout, speculators'). The folder must fit what the run builds: its target (hidden size,
vocabulary, layer ids: checked against the loaded target) and the drafter the config describes (variant,
layers, MLP width, block size, mask token, every tensor's name and shape); the first misfit is one
line naming the setting that would make them agree. A resumed run loads its checkpoint afterwards, so
``--resume`` continues the fine-tune, not the warm start.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..export.layouts import load_any_drafter
from ..model.drafter import DFlashDrafter
from ..model.target import TargetModel
from ..variants import variant_of

# spec field -> the setting that shapes it in this run
SHAPING = {
    "variant": "drafter.variant",
    "num_layers": "drafter.num_layers",
    "intermediate_size": "drafter.intermediate_size",
    "num_features": "target.num_feature_layers",
    "block_size": "drafter.block_size",
    "mask_token_id": "drafter.mask_token_id",
}


def warm_start(drafter: DFlashDrafter, init_from: str, target: TargetModel) -> None:
    """Copy the weights of the drafter folder ``init_from`` into ``drafter`` (built from the run's config
    for ``target``); ``UserError`` (one line) where the folder does not fit."""
    where = f"drafter.init_from {init_from}"
    path = Path(init_from)
    if not path.is_dir():
        raise UserError(f"{where} is not a folder: name a drafter checkpoint or an exported drafter folder")
    try:
        source, _ = load_any_drafter(path, target)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    ours, theirs = drafter.spec, source.spec
    for field, key in SHAPING.items():
        if getattr(theirs, field) != getattr(ours, field):
            raise UserError(
                f"{where} has {field} {getattr(theirs, field)!r} where this run has {getattr(ours, field)!r}: "
                f"set {key}={getattr(theirs, field)} to start from it"
            )
    shift = variant_of(theirs).label_shift(theirs), variant_of(ours).label_shift(ours)
    if shift[0] != shift[1]:
        raise UserError(
            f"{where}: its slots predict {shift[0]} token(s) further than this run's: set the drafter.{ours.variant} settings as the folder's"
        )
    state, want = source.state_dict(), drafter.state_dict()
    for name, tensor in want.items():
        if name not in state:
            raise UserError(f"{where} has no tensor {name}: its drafter.{ours.variant} settings differ from this run's")
        if state[name].shape != tensor.shape:
            raise UserError(
                f"{where}: tensor {name} is {tuple(state[name].shape)}, this run's {tuple(tensor.shape)}: "
                f"its drafter.{ours.variant} settings differ from this run's"
            )
    extra = sorted(set(state) - set(want))
    if extra:
        raise UserError(
            f"{where} has tensor {extra[0]} this run's drafter lacks: its drafter.{ours.variant} settings differ"
        )
    drafter.load_state_dict(state)
