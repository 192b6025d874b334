"""The on-policy stage's loss (Draft-OPD, arXiv 2605.29343) on the rows of the drafter's own rollouts:
a forward KL to the target on the slots the target accepted, a reverse KL on the slots it rejected.

Per row i (a block slot of a round the drafter proposed and the target verified), with ``p`` the
student's and ``q`` the target's distribution for that slot (the teacher row is the target's final
hidden state at the slot's verified prefix: the drafted tokens before it, as verification saw them):

    accepted:  T^2 KL(q^T || p^T)           mass-covering: keep what already matches
    rejected:  KL(p || q)                   mode-seeking, at T = 1: move mass off the rejected draft
    L = (sum_accepted w_i T^2 KL_i + sum_rejected w_i KL(p || q)_i) / sum_i w_i

The weights ``w`` carry the position decay (``training`` chooses it: the SFT decay on accepted slots,
a decay from the first rejected slot on the rest). Two calls of ``fused_draft_loss`` over the same
rows, each with the other's rows at weight 0 (which cost nothing): the accepted rows in the kernels,
the rejected rows in the eager passes (``LossTerms.kernel_ready``); never a ``[N, V]`` tensor.
"""

from __future__ import annotations

import torch

from .fused import fused_draft_loss
from .terms import LossTerms, PairTerm


def on_policy_terms(temperature: float = 1.0, logit_options: dict | None = None) -> tuple[LossTerms, LossTerms]:
    """``(accepted rows' terms, rejected rows' terms)``: the forward KL at ``temperature`` alone (CE
    weight 0), and the reverse KL alone (``base_weight`` 0); both label with the teacher's argmax, so
    the reported CE and accuracy are against the target's own choice for the slot. ``logit_options``:
    the target's logit transform (``logit_scale``, ``softcap``)."""
    opts = logit_options or {}
    accepted = LossTerms(kl_weight=1.0, temperature=temperature, label_source="teacher", **opts)
    reverse = PairTerm("reverse_kl", "reverse_kl", weight=1.0)
    rejected = LossTerms(base_weight=0.0, label_source="teacher", pair_terms=(reverse,), **opts)
    return accepted, rejected


def on_policy_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    accepted: torch.Tensor,
    weights: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_options: dict | None = None,
    slot_ids: torch.Tensor | None = None,
    num_slots: int | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    compile: bool | str = "auto",
) -> tuple[torch.Tensor, dict]:
    """The on-policy loss (module docstring) of ``student_hidden`` ``[N, H]`` against ``teacher_hidden``
    ``[N, H]`` through the frozen head ``[V, H]``; ``accepted`` ``[N]`` bool, ``weights`` ``[N]`` >= 0;
    ``logit_options`` the target's logit transform (``DrafterSpec.logit_options``).

    Returns ``(loss, metrics)``: ``forward_kl`` (mean over the accepted rows with weight, before T^2),
    ``reverse_kl`` (mean over the rejected ones), ``accepted_rows``, ``rejected_rows``, ``agreement``
    (student argmax equals the target's, over both), and with ``slot_ids`` ``per_slot`` tensors
    ``[num_slots]`` of the two KLs and the row counts."""
    if accepted.shape != weights.shape or accepted.dtype != torch.bool:
        raise ValueError(
            f"on_policy_loss: accepted must be a bool tensor shaped like weights {tuple(weights.shape)}, "
            f"got {tuple(accepted.shape)} {accepted.dtype}"
        )
    on_accepted, on_rejected = on_policy_terms(temperature, logit_options)
    zero = torch.zeros_like(weights)
    w_acc, w_rej = torch.where(accepted, weights, zero), torch.where(accepted, zero, weights)
    kw = dict(
        slot_ids=slot_ids,
        num_slots=num_slots,
        chunk_size=chunk_size,
        memory_budget=memory_budget,
        compile=compile,
    )
    loss_acc, m_acc = fused_draft_loss(student_hidden, teacher_hidden, lm_head_weight, None, w_acc, on_accepted, **kw)
    loss_rej, m_rej = fused_draft_loss(student_hidden, teacher_hidden, lm_head_weight, None, w_rej, on_rejected, **kw)
    # each call is its rows' weighted mean: the whole is their mix by weight
    s_acc, s_rej = w_acc.sum().to(loss_acc.dtype), w_rej.sum().to(loss_acc.dtype)
    total = (s_acc + s_rej).clamp(min=torch.finfo(loss_acc.dtype).tiny)
    loss = (s_acc * loss_acc + s_rej * loss_rej) / total
    rows_acc, rows_rej = m_acc["rows"], m_rej["rows"]
    metrics = {
        "forward_kl": m_acc["kl"],
        "reverse_kl": m_rej["reverse_kl"],
        "accepted_rows": rows_acc,
        "rejected_rows": rows_rej,
        "agreement": (m_acc["agreement"] * rows_acc + m_rej["agreement"] * rows_rej)
        / (rows_acc + rows_rej).clamp(min=1),
    }
    if slot_ids is not None:
        metrics["per_slot"] = {
            "forward_kl": m_acc["per_slot"]["kl"],
            "reverse_kl": m_rej["per_slot"]["reverse_kl"],
            "accepted_rows": m_acc["per_slot"]["rows"],
            "rejected_rows": m_rej["per_slot"]["rows"],
        }
    return loss, metrics
