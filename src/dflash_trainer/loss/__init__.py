"""The draft loss: one entry point (``fused_draft_loss``) taking a typed terms object
(``LossTerms``), the chunk loop written once (``chunks``), one module per implementation of a chunk's
element-wise work (``eager``, ``native``, ``triton_epilogue``), and the plain reference it is tested
against (``reference``)."""

from .candidates import candidate_logits
from .chunks import chunk_rows
from .fused import fused_draft_loss
from .logits import transform_logits
from .reference import reference_draft_loss
from .terms import BlockCredit, LossTerms, PairTerm
from .weights import slot_weights

__all__ = [
    "BlockCredit",
    "LossTerms",
    "PairTerm",
    "candidate_logits",
    "chunk_rows",
    "fused_draft_loss",
    "reference_draft_loss",
    "slot_weights",
    "transform_logits",
]
