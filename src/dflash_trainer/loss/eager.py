"""The eager implementation of one chunk's element-wise work: separate torch passes over fp32
(fp64 for fp64 inputs) ``[c, V]`` buffers, about a dozen reads or writes of each. Any device; the
fallback where neither kernel runs, and the only one with a weighted ``overlap`` term's gradient."""

from __future__ import annotations

import torch

from .logits import chain_to_raw, logits_into
from .terms import LossTerms


def eager_chunk(
    hs_rows, ht_rows, weight, y_data, coef, t: LossTerms, buffers, dh_rows, bias=None, credit=None, extra=None
):
    """One chunk in separate eager passes over fp32 (fp64) ``[c, V]`` buffers; writes ``G @ W`` into ``dh_rows``.

    Returns ``(lse, z_y, s_arg, t_arg, entropy, kl, logits_of)``, all ``[c]`` but ``logits_of``, which
    gives the transformed logits of some rows (valid until the next chunk). Live ``[c, V]`` buffers:
    student logits ``zs``, student probabilities ``p`` (turned into the gradient in place), teacher
    logits (turned into ``q`` in place), the tempered student log-probabilities when T != 1, and one
    transient (logsumexp / entropy reductions). The pair statistics (``t.pair_statistics``) add one
    buffer ``r`` (teacher probabilities, then sqrt(p q), then the pair terms' gradient) and one
    transient; ``credit`` turns the chunk's label probabilities or overlaps ``[c]`` (``t.credit``) into
    its rows' coefficients, and ``extra`` (a dict) receives ``overlap``, ``renyi_half`` (with
    ``t.reverse_kl`` also ``reverse_kl``) and ``coef`` ``[c]``, and with ``t.top_k`` K > 0 ``topk`` = (logits ``[c, K]``, ids ``[c, K]``) of ``torch.topk``
    over the transformed logits.
    """
    a, temp, tc = t.kl_weight, t.temperature, t.cap_temperature
    zs = logits_into(hs_rows, weight, t, buffers["zs"], bias)  # [c, V]
    m_s, s_arg = zs.max(-1)  # one pass gives the shift for a stable softmax and the argmax
    if t.top_k and extra is not None:  # zs is never written in place below: any point would do
        extra["topk"] = tuple(torch.topk(zs, t.top_k, dim=-1))
    p = torch.sub(zs, m_s[:, None], out=buffers["p"]).exp_()
    sum_s = p.sum(-1)
    lse = m_s + sum_s.log()  # [c]
    p.mul_(sum_s.reciprocal()[:, None])  # student probabilities
    zt = logits_into(ht_rows, weight, t, buffers["zt"]) if ht_rows is not None else None
    t_arg = None
    if zt is not None:
        m_t, t_arg = zt.max(-1)
    y = t_arg if t.label_source == "teacher" else y_data
    z_y = zs.gather(1, y[:, None]).squeeze(1)
    confidence = t.credit.confidence if t.credit is not None else None
    if confidence == "label_prob":  # D-PACE: the credit of the detached p(y), before any gradient uses coef
        coef = credit(torch.exp(z_y - lse))
    renyi_g = None
    if t.pair_statistics:  # at T = 1, before the KL pass turns zt into q^T in place
        w_half, w_overlap = t.gradient_weight("renyi_half"), t.gradient_weight("overlap")
        pt = torch.sub(zt, m_t[:, None], out=buffers["r"]).exp_()
        sum_t = pt.sum(-1)
        pt.mul_(sum_t.reciprocal()[:, None])  # teacher probabilities
        accept = torch.minimum(p, pt).sum(-1)  # the overlap a = sum_v min(p_v, q_v)
        below = (p < pt) if (w_overlap != 0 and dh_rows is not None) else None  # the overlap's mask, bool [c, V]
        bc = pt.mul_(p).sqrt_().sum(-1)  # Bhattacharyya coefficient sum_v sqrt(p_v q_v)
        if confidence == "overlap":
            coef = credit(accept)
        extra.update(overlap=accept, renyi_half=-2.0 * bc.log(), coef=coef)
        if w_half != 0 and dh_rows is not None:
            # d(-2 log BC)/dz_v = p_v - sqrt(p_v q_v) / BC, weighted like the other terms
            renyi_g = pt.mul_(bc.reciprocal()[:, None]).neg_().add_(p).mul_((w_half * coef)[:, None])
        if below is not None:
            # d(sum_u min(p_u, q_u))/dz_v = p_v (m_v - S), m_v = [p_v < q_v], S = sum_u m_u p_u; times
            # -w_overlap: p_v (S - m_v). Built in the teacher buffer when the Renyi gradient does not hold
            # it, else as one transient added to it.
            mp = torch.mul(p, below, out=None if renyi_g is not None else pt)
            below = None
            scale, below_mass = -w_overlap * coef, mp.sum(-1)  # [c]: the weight and S
            mp.mul_((-scale)[:, None]).addcmul_(p, (scale * below_mass)[:, None])
            renyi_g = renyi_g.add_(mp) if renyi_g is not None else mp
            mp = None
        if t.reverse_kl:  # KL(p || q) = sum_v p_v (log p_v - log q_v), from the logits: one transient [c, V]
            log_ratio = torch.sub(zs, zt).add_((m_t + sum_t.log() - lse)[:, None])  # log p - log q
            reverse = torch.linalg.vecdot(p, log_ratio)  # [c]
            extra["reverse_kl"] = reverse
            w_reverse = t.gradient_weight("reverse_kl")
            if w_reverse != 0 and dh_rows is not None:
                # d KL(p || q) / dz_v = p_v (log p_v - log q_v - KL), weighted like the other terms
                g_reverse = log_ratio.sub_(reverse[:, None]).mul_(p).mul_((w_reverse * coef)[:, None])
                renyi_g = renyi_g.add_(g_reverse) if renyi_g is not None else g_reverse
            log_ratio = g_reverse = None
        pt = None
    elif extra is not None:
        extra.update(coef=coef)
    if a == 0:
        zt = None  # the teacher logits were only needed for labels and agreement

    # CAP statistic: entropy of softmax(z / Tc) (the mask `correct` carries no gradient).
    if tc == 1.0:
        entropy = lse - torch.linalg.vecdot(p, zs)
    else:
        pc = zs / tc
        pc.sub_(torch.logsumexp(pc, -1, keepdim=True))  # log pc
        entropy = -torch.linalg.vecdot(pc.exp(), pc)
        del pc

    # Soft KL at temperature T: KL(q^T || p^T) = sum q log q - sum q log p^T.
    kl = torch.zeros_like(lse)
    if a > 0:
        u = zt.sub_(m_t[:, None])  # shifted teacher logits, in place
        if temp != 1.0:
            u.div_(temp)
        q = torch.exp(u, out=buffers["q"])
        sum_t = q.sum(-1)
        neg_entropy_q = u.mul_(q).sum(-1) / sum_t - sum_t.log()  # u is not needed after this
        q.mul_(sum_t.reciprocal()[:, None])  # teacher q^T
        zt = u = None
        if temp == 1.0:
            log_pt = None
            cross = torch.linalg.vecdot(q, zs) - lse
        else:
            log_pt = zs / temp
            log_pt.sub_(torch.logsumexp(log_pt, -1, keepdim=True))
            cross = torch.linalg.vecdot(q, log_pt)
        kl = neg_entropy_q - cross

    if dh_rows is not None:
        # p becomes G in place: w b [ (1-a)(p - e_y) + a T (p^T - q^T) ] / sum w, b = base_weight
        base = t.base_weight * coef  # [c]
        if a > 0 and temp == 1.0:  # p^T = p: G = b coef (p - a q) - (1-a) b coef e_y
            p.mul_(base[:, None]).addcmul_(q, base[:, None], value=-a)
        else:
            p.mul_(((1 - a) * base)[:, None])
            if a > 0:
                pt_minus_q = log_pt.exp_().sub_(q)
                p.addcmul_(pt_minus_q, base[:, None], value=a * temp)
        p.scatter_add_(1, y[:, None], (-(1 - a) * base)[:, None])
        if renyi_g is not None:
            p.add_(renyi_g)
        q = log_pt = pt_minus_q = renyi_g = None
        chain_to_raw(p, zs, t)
        if weight.dtype == dh_rows.dtype:
            torch.mm(p, weight, out=dh_rows)
        else:
            dh_rows.copy_(p.to(weight.dtype).matmul(weight))
        if bias is not None:
            bias.backward(p)
    return lse, z_y, s_arg, t_arg, entropy, kl, lambda idx: zs[idx]
