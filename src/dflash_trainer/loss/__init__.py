"""The draft loss: a fused chunked implementation and the plain reference it is tested against."""

from .candidates import candidate_logits
from .fused import chunk_rows, fused_draft_loss
from .logits import transform_logits
from .reference import reference_draft_loss
from .weights import slot_weights

__all__ = [
    "candidate_logits",
    "chunk_rows",
    "fused_draft_loss",
    "reference_draft_loss",
    "slot_weights",
    "transform_logits",
]
