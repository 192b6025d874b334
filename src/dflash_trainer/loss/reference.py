"""Plain reference of the draft loss: full ``[N, V]`` logits and autograd.

It materializes everything the fused loss avoids, so it is only for tests (float64 exactness) and
benchmarks. Math (shared/DESIGN.md section 3), with z = logits after the target's scaling/softcap:

    L   = sum_i w_i [ (1-a) CE(p_i, y_i) + a T^2 KL(q_i^T || p_i^T) ] / sum_i w_i  +  lambda * CAP
    CAP = mean over rows (w_i > 0) whose student argmax equals y_i of the entropy of softmax(z_i / Tc)

DSpark (``fused_draft_loss``'s docstring): z_i += e_i W2^T (the Markov bias), a_i = sum_v min(p, q),
the Renyi-1/2 term beta * (-2 log sum_v sqrt(p q)), and D-PARD credit weights W_t computed here with
a plain loop over blocks; D-PACE the same credit of the student's label probability p(y_i); TV the
total variation 0.5 sum_v |p - q| (the fused loss computes it as 1 - a_i).
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
    bias_rows: torch.Tensor | None = None,  # [N, r]
    bias_weight: torch.Tensor | None = None,  # [V, r]
    block_ids: torch.Tensor | None = None,  # [N]
    renyi_weight: float = 0.0,
    acceptance: bool = False,
    dpard: bool = False,
    dpard_alpha: float = 0.5,
    top_k: int = 0,
    dpace: bool = False,
    dpace_alpha: float = 0.5,
    tv_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns ``(loss, metrics)``; computed in float64 if the inputs are, else float32. With ``top_k``
    K > 0 the metrics hold ``topk_ids`` ``[N, K]`` and ``topk_logits`` ``[N, K]``: ``torch.topk`` of the
    full transformed student logits, -1 and -inf at weight-0 rows."""
    f = torch.promote_types(student_hidden.dtype, torch.float32)
    w_mat = lm_head_weight.to(f)
    keep = weights > 0
    raw = student_hidden.to(f) @ w_mat.T
    if bias_rows is not None:
        raw = raw + bias_rows.to(f) @ bias_weight.to(f).T  # the full [N, V] bias: this is the reference
    z_all = transform_logits(raw, logit_scale, softcap)  # [N, V]
    zs = z_all[keep]  # [n, V]
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
    per_row = acceptance or renyi_weight > 0 or dpard or tv_weight > 0
    accept = None
    if per_row:
        p, q = F.softmax(zs, -1), F.softmax(zt, -1)
        accept = torch.minimum(p, q).sum(-1).detach()
        renyi = -2 * (p * q).sqrt().sum(-1).log()
        if renyi_weight > 0:
            loss_rows = loss_rows + renyi_weight * renyi
        tv = 0.5 * (p - q).abs().sum(-1)  # total variation, as the definition writes it
        if tv_weight > 0:
            loss_rows = loss_rows + tv_weight * tv
    if dpard or dpace:
        ids = block_ids[keep].tolist()
        alpha = dpard_alpha if dpard else dpace_alpha
        conf = accept if dpard else torch.exp(-ce).detach()  # D-PACE: the student's p(y)
        credit = torch.zeros_like(ce)
        for i in range(len(ids)):  # W_t = sum over later rows k of its block of prod_{i <= k} s_i
            for k in range(i, len(ids)):
                if ids[k] != ids[i]:
                    break
                prod = 1.0
                for j in range(k + 1):
                    if ids[j] == ids[i]:
                        prod = prod * (alpha + (1 - alpha) * conf[j])
                credit[i] += prod
        loss = (credit * loss_rows).sum() / len(ids)
    else:
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
    if per_row:
        metrics["accept"] = accept.mean()
        metrics["renyi"] = renyi.mean().detach()
        if tv_weight > 0:
            metrics["tv"] = tv.mean().detach()
        rows = torch.zeros(weights.shape[0], dtype=f, device=weights.device)
        rows[keep] = accept
        metrics["accept_rows"] = rows
    if top_k:
        top_logits, top_ids = torch.topk(z_all.detach(), top_k, dim=-1)
        metrics["topk_ids"] = torch.where(keep[:, None], top_ids, -1)
        metrics["topk_logits"] = torch.where(keep[:, None], top_logits, -torch.inf)
    return loss, metrics
