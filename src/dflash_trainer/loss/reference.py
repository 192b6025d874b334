"""Plain reference of the draft loss: full ``[N, V]`` logits and autograd.

It materializes everything the fused loss avoids, so it is only for tests (float64 exactness) and
benchmarks. Math (shared/DESIGN.md section 3), with z = logits after the target's scaling/softcap:

    L   = sum_i w_i b [ (1-a) CE(p_i, y_i) + a T^2 KL(q_i^T || p_i^T) ] / sum_i w_i  +  lambda * CAP
    CAP = mean over rows (w_i > 0) whose student argmax equals y_i of the entropy of softmax(z_i / Tc)

The terms are ``loss.terms.LossTerms``: a low-rank bias z_i += e_i W2^T, the pair statistics as their
definitions write them (the overlap as 1 - 0.5 sum_v |p - q|, which the fused loss computes as
sum_v min(p, q); -2 log sum_v sqrt(p q); the reverse KL from the two log-softmaxes), ``b`` the
``base_weight``, and a block credit computed here with a plain loop over blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .logits import transform_logits
from .terms import LossTerms


def reference_draft_loss(
    student_hidden: torch.Tensor,  # [N, H], requires grad
    teacher_hidden: torch.Tensor | None,  # [N, H]
    lm_head_weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [N]
    terms: LossTerms | None = None,
    *,
    bias_rows: torch.Tensor | None = None,  # [N, r]
    bias_weight: torch.Tensor | None = None,  # [V, r]
    block_ids: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns ``(loss, metrics)``; computed in float64 if the inputs are, else float32. With ``top_k``
    K > 0 the metrics hold ``topk_ids`` ``[N, K]`` and ``topk_logits`` ``[N, K]``: ``torch.topk`` of the
    full transformed student logits, -1 and -inf at weight-0 rows."""
    t = LossTerms() if terms is None else terms
    kl_weight, temperature, label_source = t.kl_weight, t.temperature, t.label_source
    f = torch.promote_types(student_hidden.dtype, torch.float32)
    w_mat = lm_head_weight.to(f)
    keep = weights > 0
    raw = student_hidden.to(f) @ w_mat.T
    if bias_rows is not None:
        raw = raw + bias_rows.to(f) @ bias_weight.to(f).T  # the full [N, V] bias: this is the reference
    z_all = transform_logits(raw, t.logit_scale, t.softcap)  # [N, V]
    zs = z_all[keep]  # [n, V]
    w = weights[keep].to(f)
    y = labels[keep] if labels is not None else None
    zt = None
    if teacher_hidden is not None:
        zt = transform_logits(teacher_hidden.to(f) @ w_mat.T, t.logit_scale, t.softcap)[keep].detach()
        if label_source == "teacher":
            y = zt.argmax(-1)
    ce = F.cross_entropy(zs, y, reduction="none")
    blend = (1 - kl_weight) * ce
    kl = torch.zeros_like(ce)
    if kl_weight > 0:
        log_q = F.log_softmax(zt / temperature, -1)
        log_p = F.log_softmax(zs / temperature, -1)
        kl = (log_q.exp() * (log_q - log_p)).sum(-1)
        blend = blend + kl_weight * temperature**2 * kl
    loss_rows = t.base_weight * blend
    statistics = {}
    if t.pair_statistics:  # as their definitions write them
        p, q = F.softmax(zs, -1), F.softmax(zt, -1)
        statistics["overlap"] = 1 - 0.5 * (p - q).abs().sum(-1)  # 1 - TV = sum_v min(p_v, q_v)
        statistics["renyi_half"] = -2 * (p * q).sqrt().sum(-1).log()
        statistics["reverse_kl"] = (p * (F.log_softmax(zs, -1) - F.log_softmax(zt, -1))).sum(-1)  # KL(p || q)
        for term in t.pair_terms:
            if term.weight > 0:
                loss_rows = loss_rows + term.weight * (term.offset + term.scale * statistics[term.statistic])
    if t.credit is not None:
        ids = block_ids[keep].tolist()
        alpha = t.credit.alpha
        conf = statistics["overlap"] if t.credit.confidence == "overlap" else torch.exp(-ce)  # D-PARD; D-PACE: p(y)
        conf = conf.detach()
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
    log_pc = F.log_softmax(zs / t.cap_temperature, -1)
    entropy = -(log_pc.exp() * log_pc).sum(-1)
    cap = entropy[correct].mean() if correct.any() else entropy.sum() * 0
    if t.cap_weight > 0:
        loss = loss + t.cap_weight * cap
    metrics = {
        "ce": ce.mean().detach(),
        "kl": kl.mean().detach(),
        "cap": cap.detach(),
        "accuracy": correct.to(f).mean(),
    }
    if zt is not None:
        metrics["agreement"] = (zs.argmax(-1) == zt.argmax(-1)).to(f).mean()
    for term in t.pair_terms:
        metrics[term.name] = (term.offset + term.scale * statistics[term.statistic]).mean().detach()
    if t.pair_statistics:
        rows = torch.zeros(weights.shape[0], dtype=f, device=weights.device)
        rows[keep] = statistics["overlap"].detach()
        metrics["overlap_rows"] = rows
    if t.top_k:
        top_logits, top_ids = torch.topk(z_all.detach(), t.top_k, dim=-1)
        metrics["topk_ids"] = torch.where(keep[:, None], top_ids, -1)
        metrics["topk_logits"] = torch.where(keep[:, None], top_logits, -torch.inf)
    return loss, metrics
