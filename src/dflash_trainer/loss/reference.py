"""Plain reference of the draft loss: full ``[N, V]`` logits and autograd.

It materializes everything the fused loss avoids, so it is only for tests (float64 exactness) and
benchmarks. Math (shared/DESIGN.md section 3), with z = logits after the target's scaling/softcap:

    L   = sum_i w_i [ (1-a) CE(p_i, y_i) + a T^2 KL(q_i^T || p_i^T) ] / sum_i w_i  +  lambda * CAP
    CAP = mean over rows (w_i > 0) whose student argmax equals y_i of the entropy of softmax(z_i / Tc)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .logits import transform_logits


def reference_draft_loss(
    student_hidden: torch.Tensor,  # [N, H], requires grad
    teacher_hidden: torch.Tensor | None,  # [N, H]
    lm_head_weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [N]
    *,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
    cap_weight: float = 0.0,
    cap_temperature: float = 1.0,
    label_source: str = "data",
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns ``(loss, metrics)``; computed in float64 if the inputs are, else float32."""
    f = torch.promote_types(student_hidden.dtype, torch.float32)
    w_mat = lm_head_weight.to(f)
    keep = weights > 0
    zs = transform_logits(student_hidden.to(f) @ w_mat.T, logit_scale, softcap)[keep]  # [n, V]
    w = weights[keep].to(f)
    y = labels[keep]
    zt = None
    if teacher_hidden is not None:
        zt = transform_logits(teacher_hidden.to(f) @ w_mat.T, logit_scale, softcap)[keep].detach()
        if label_source == "teacher":
            y = zt.argmax(-1)
    ce = F.cross_entropy(zs, y, reduction="none")
    loss_rows = (1 - kl_weight) * ce
    kl = torch.zeros_like(ce)
    if kl_weight > 0:
        log_q = F.log_softmax(zt / temperature, -1)
        log_p = F.log_softmax(zs / temperature, -1)
        kl = (log_q.exp() * (log_q - log_p)).sum(-1)
        loss_rows = loss_rows + kl_weight * temperature**2 * kl
    loss = (w * loss_rows).sum() / w.sum()
    correct = zs.argmax(-1) == y
    log_pc = F.log_softmax(zs / cap_temperature, -1)
    entropy = -(log_pc.exp() * log_pc).sum(-1)
    cap = entropy[correct].mean() if correct.any() else entropy.sum() * 0
    if cap_weight > 0:
        loss = loss + cap_weight * cap
    metrics = {
        "ce": ce.mean().detach(),
        "kl": kl.mean().detach(),
        "cap": cap.detach(),
        "accuracy": correct.to(f).mean(),
    }
    if zt is not None:
        metrics["agreement"] = (zs.argmax(-1) == zt.argmax(-1)).to(f).mean()
    return loss, metrics
