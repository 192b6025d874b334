"""The draft loss: one entry point (``fused_draft_loss``) taking a typed terms object
(``LossTerms``), the chunk loop written once (``chunks``), one module per implementation of a chunk's
element-wise work (``eager``, ``native``, ``triton_epilogue``), the plain reference it is tested
against (``reference``), and the on-policy stage's loss built on it (``on_policy``)."""

from .candidates import candidate_logits
from .chunks import chunk_rows
from .fused import fused_draft_loss
from .logits import transform_logits
from .on_policy import on_policy_loss, on_policy_terms
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
    "on_policy_loss",
    "on_policy_terms",
    "reference_draft_loss",
    "slot_weights",
    "transform_logits",
]
