"""The fused draft loss: CE + soft KL + CAP from hidden states, never materializing ``[N, V]``.

One ``torch.autograd.Function`` walks the rows in chunks of ``c``. Per chunk it computes the student
and teacher logits in fp32 (fp64 for fp64 inputs), the loss terms, and the closed-form gradient with
respect to the student logits (shared/DESIGN.md section 3):

    G_i = w_i [ (1-a)(p_i - e_y) + a T (p_i^T - q_i^T) ] / sum w  -  (lambda / n_correct) / Tc * pc_i (log pc_i + H_i)

then writes ``dh_s[chunk] = G @ W`` (chain rule through the target's logit scale and softcap
included). Backward only returns ``grad_output * dh_s``: the head is frozen, so there is no weight
gradient, and the GEMM work is 6NHV FLOPs in all (student logits, teacher logits, G @ W).

Memory beyond the inputs: ``dh_s`` (``N*H*4`` bytes, twice with CAP, whose normalization by the
global number of correct rows is only known after the last chunk) plus, per chunk, three fp32
``[c, V]`` buffers and one transient (four buffers with KL at T != 1): ``c*V*16`` to ``c*V*20``
bytes, about the ``c*V*18`` of DESIGN.md; CAP's correct-row subset and a bf16 head's GEMM output
reach ``c*V*26`` at worst. Softcap adds one transient in the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bytes per chunk element that the chunk loop keeps alive at its worst, used to size chunks from a
# byte budget: 16-20 for the common cases above, 24 for KL at T != 1 and 26 for CAP with every row
# correct and a bf16 head (the subset buffers and the bf16 GEMM output), as the planner's allocator
# log measured; the budget must hold in the worst case.
BYTES_PER_CHUNK_ELEMENT = 26
DEFAULT_MEMORY_BUDGET = 256 * 2**20  # 256 MiB of chunk workspace when neither chunk_size nor budget is given


@dataclass(frozen=True)
class LossTerms:
    kl_weight: float = 0.0
    temperature: float = 1.0
    cap_weight: float = 0.0
    cap_temperature: float = 1.0
    label_source: str = "data"  # "data" or "teacher"
    logit_scale: float = 1.0
    softcap: float | None = None


def chunk_rows(vocab_size: int, chunk_size: int | None, memory_budget: int | None) -> int:
    """Rows per chunk: explicit, or the most whose worst-case workspace ``c*V*26`` bytes fits ``memory_budget``."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    rows = budget // (vocab_size * BYTES_PER_CHUNK_ELEMENT)
    if rows < 1:
        raise ValueError(
            f"memory_budget {budget} bytes is below one row's workspace ({vocab_size * BYTES_PER_CHUNK_ELEMENT} "
            f"bytes for vocabulary {vocab_size})"
        )
    return int(rows)


def _logits(
    h: torch.Tensor | None, weight: torch.Tensor, t: LossTerms, out: torch.Tensor | None
) -> torch.Tensor | None:
    """``[c, H] -> [c, V]`` logits in ``out``'s dtype (fp32/fp64), scaled and soft-capped in place.

    ``out`` is a reused workspace buffer: fresh multi-MB allocations per chunk would page-fault."""
    if h is None:
        return None
    if weight.dtype == out.dtype:
        z = torch.mm(h, weight.T, out=out)
    else:  # the GEMM runs in the head's dtype (bf16); logits are upcast per chunk
        z = out.copy_(h @ weight.T)
    if t.logit_scale != 1.0:
        z.mul_(t.logit_scale)
    if t.softcap:
        z.div_(t.softcap).tanh_().mul_(t.softcap)
    return z


def _chain_to_raw(g: torch.Tensor, z: torch.Tensor, t: LossTerms) -> torch.Tensor:
    """Turn a gradient w.r.t. transformed logits ``z`` into one w.r.t. raw logits, in place."""
    if t.softcap:
        factor = z / t.softcap  # d(cap*tanh(r/cap))/dr = 1 - tanh^2 = 1 - (z/cap)^2
        g.mul_(factor.square_().neg_().add_(1.0))
        del factor
    if t.logit_scale != 1.0:
        g.mul_(t.logit_scale)
    return g


@torch.no_grad()
def _run_chunks(hs, ht, weight, labels, weights, slot_ids, num_slots, t: LossTerms, chunk: int, want_grad: bool):
    """The chunk loop. Inputs are already compacted to rows with weight > 0.

    Returns ``(loss, stats, dh)`` where ``stats`` is ``[num_slots or 1, 7]`` float64 sums of
    (rows, ce, kl, entropy of correct rows, correct, agreement, label probability) and ``dh``
    ``[n, H]`` is the gradient of the loss w.r.t. ``hs`` (None unless ``want_grad``).

    Live ``[c, V]`` buffers per chunk: student logits ``zs``, student probabilities ``p`` (turned into
    the gradient in place), teacher logits (turned into ``q`` in place), the tempered student
    log-probabilities when T != 1, and one transient (logsumexp / entropy reductions).
    """
    n, hidden = hs.shape
    f = torch.promote_types(hs.dtype, torch.float32)
    a, temp, tc = t.kl_weight, t.temperature, t.cap_temperature
    inv_wsum = 1.0 / weights.double().sum().item()
    dev = hs.device
    stats = torch.zeros(num_slots or 1, 7, dtype=torch.float64, device=dev)
    dh = torch.zeros(n, hidden, dtype=f, device=dev) if want_grad else None
    dh_cap = torch.zeros(n, hidden, dtype=f, device=dev) if (want_grad and t.cap_weight > 0) else None
    loss_main = torch.zeros((), dtype=torch.float64, device=dev)
    cap_sum, n_correct = torch.zeros((), dtype=torch.float64, device=dev), 0
    c_max, vocab = min(chunk, n), weight.shape[0]
    buffers = {
        name: torch.empty(c_max, vocab, dtype=f, device=dev)
        for name, needed in (("zs", True), ("p", True), ("zt", ht is not None), ("q", a > 0))
        if needed
    }

    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        w = weights[rows].to(f)
        c = rows.stop - rows.start
        zs = _logits(hs[rows], weight, t, buffers["zs"][:c])  # [c, V]
        m_s, s_arg = zs.max(-1)  # one pass gives the shift for a stable softmax and the argmax
        p = torch.sub(zs, m_s[:, None], out=buffers["p"][:c]).exp_()
        sum_s = p.sum(-1)
        lse = m_s + sum_s.log()  # [c]
        p.mul_(sum_s.reciprocal()[:, None])  # student probabilities
        zt = _logits(ht[rows], weight, t, buffers["zt"][:c]) if ht is not None else None
        t_arg = None
        if zt is not None:
            m_t, t_arg = zt.max(-1)
        y = t_arg if t.label_source == "teacher" else labels[rows]
        if a == 0:
            zt = None  # the teacher logits were only needed for labels and agreement
        z_y = zs.gather(1, y[:, None]).squeeze(1)
        ce = lse - z_y
        correct = s_arg == y

        # CAP statistic: entropy of softmax(z / Tc) (the mask `correct` carries no gradient).
        if tc == 1.0:
            entropy = lse - torch.linalg.vecdot(p, zs)
        else:
            pc = zs / tc
            pc.sub_(torch.logsumexp(pc, -1, keepdim=True))  # log pc
            entropy = -torch.linalg.vecdot(pc.exp(), pc)
            del pc
        cap_sum += entropy[correct].double().sum()
        n_correct += int(correct.sum())

        # Soft KL at temperature T: KL(q^T || p^T) = sum q log q - sum q log p^T.
        kl = torch.zeros_like(ce)
        if a > 0:
            u = zt.sub_(m_t[:, None])  # shifted teacher logits, in place
            if temp != 1.0:
                u.div_(temp)
            q = torch.exp(u, out=buffers["q"][:c])
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
        loss_main += (w * ((1 - a) * ce + a * temp**2 * kl)).double().sum() * inv_wsum

        if want_grad:
            # p becomes G in place: w [ (1-a)(p - e_y) + a T (p^T - q^T) ] / sum w
            coef = w * inv_wsum  # [c]
            if a > 0 and temp == 1.0:  # p^T = p: G = coef (p - a q) - (1-a) coef e_y
                p.mul_(coef[:, None]).addcmul_(q, coef[:, None], value=-a)
            else:
                p.mul_(((1 - a) * coef)[:, None])
                if a > 0:
                    pt_minus_q = log_pt.exp_().sub_(q)
                    p.addcmul_(pt_minus_q, coef[:, None], value=a * temp)
            p.scatter_add_(1, y[:, None], (-(1 - a) * coef)[:, None])
            q = log_pt = pt_minus_q = None
            _chain_to_raw(p, zs, t)
            if weight.dtype == f:
                torch.mm(p, weight, out=dh[rows])
            else:
                dh[rows] = p.to(weight.dtype).matmul(weight).to(f)
            p = None
            if dh_cap is not None and correct.any():
                # d entropy / dz = -(1/Tc) pc (log pc + H), on the correct rows only.
                idx = correct.nonzero().squeeze(1)
                z_idx = zs[idx] if t.softcap else zs  # the softcap chain rule needs these rows' logits
                g = zs[idx].div_(tc)
                g.sub_(torch.logsumexp(g, -1, keepdim=True))  # log pc
                pc = g.exp()
                g.add_(entropy[idx, None]).mul_(pc).mul_(-1.0 / tc)
                pc = None
                _chain_to_raw(g, z_idx, t)
                dh_cap[start + idx] = g.to(weight.dtype).matmul(weight).to(f)
                g = z_idx = None
        q = log_pt = p = zt = None

        # Statistics, per slot when slot ids are given.
        group = slot_ids[rows] if num_slots else torch.zeros_like(y)
        agree = (s_arg == t_arg) if t_arg is not None else torch.zeros_like(correct)
        cols = torch.stack(
            [
                torch.ones_like(ce),
                ce,
                kl,
                torch.where(correct, entropy, 0.0),
                correct.to(f),
                agree.to(f),
                torch.exp(z_y - lse),
            ],
            1,
        ).double()
        stats.index_add_(0, group, cols)
        del zs

    cap = cap_sum / max(n_correct, 1)
    loss = loss_main + t.cap_weight * cap
    if dh_cap is not None and n_correct:
        dh.add_(dh_cap, alpha=t.cap_weight / n_correct)
    return loss, stats, dh


class _FusedDraftLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ht, weight, labels, weights, slot_ids, num_slots, terms, chunk):
        loss, stats, dh = _run_chunks(hs, ht, weight, labels, weights, slot_ids, num_slots, terms, chunk, True)
        ctx.save_for_backward(dh)
        ctx.hs_dtype = hs.dtype
        ctx.mark_non_differentiable(stats)
        return loss.to(dh.dtype), stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        (dh,) = ctx.saved_tensors
        grad_hs = (dh * grad_loss.to(dh.dtype)).to(ctx.hs_dtype)
        return grad_hs, None, None, None, None, None, None, None, None


def _check(name: str, ok: bool, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"fused_draft_loss: {name} must be {expected}, got {got}")


def fused_draft_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    weights: torch.Tensor,
    *,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
    cap_weight: float = 0.0,
    cap_temperature: float = 1.0,
    label_source: str = "data",
    logit_scale: float = 1.0,
    softcap: float | None = None,
    slot_ids: torch.Tensor | None = None,
    num_slots: int | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The draft loss of ``student_hidden`` against ``teacher_hidden`` through the frozen head.

    Shapes: ``student_hidden`` and ``teacher_hidden`` ``[N, H]`` (the teacher row i is the target's
    final-normed hidden state that predicts the same token as student row i), ``lm_head_weight``
    ``[V, H]``, ``labels`` ``[N]`` token ids (ignored with ``label_source="teacher"``), ``weights``
    ``[N]`` >= 0 (rows with weight 0 cost nothing), ``slot_ids`` ``[N]`` in ``0..num_slots-1``.
    ``teacher_hidden`` may be None for CE with data labels (the teacher GEMM is then skipped).

    Returns ``(loss, metrics)``: a scalar (fp32, fp64 for fp64 inputs) that backpropagates into
    ``student_hidden`` only, and detached metrics: ``ce``, ``kl``, ``cap``, ``accuracy`` (student argmax
    equals label), ``agreement`` (student argmax equals teacher argmax), ``label_prob``, ``rows``,
    ``correct``; with ``slot_ids`` also ``per_slot`` tensors ``[num_slots]`` of the same.
    """
    hs, ht, w_head = student_hidden, teacher_hidden, lm_head_weight
    _check("student_hidden", hs.dim() == 2 and hs.is_floating_point(), "a floating [N, H] tensor", tuple(hs.shape))
    n, hidden = hs.shape
    _check("lm_head_weight", w_head.dim() == 2 and w_head.shape[1] == hidden, f"[V, {hidden}]", tuple(w_head.shape))
    _check(
        "lm_head_weight.requires_grad",
        not w_head.requires_grad,
        "False (the head is frozen; pass weight.detach())",
        True,
    )
    _check("lm_head_weight.dtype", w_head.dtype == hs.dtype, f"{hs.dtype} like student_hidden", w_head.dtype)
    vocab = w_head.shape[0]
    _check("label_source", label_source in ("data", "teacher"), "'data' or 'teacher'", repr(label_source))
    _check("kl_weight", 0.0 <= kl_weight <= 1.0, "in [0, 1]", kl_weight)
    _check("temperature", temperature > 0, "> 0", temperature)
    _check("cap_temperature", cap_temperature > 0, "> 0", cap_temperature)
    _check("cap_weight", cap_weight >= 0, ">= 0", cap_weight)
    _check("softcap", softcap is None or softcap > 0, "None or > 0", softcap)
    if ht is None:
        _check(
            "teacher_hidden",
            kl_weight == 0 and label_source == "data",
            "given when kl_weight > 0 or label_source='teacher'",
            None,
        )
    else:
        _check("teacher_hidden", ht.shape == hs.shape, f"shaped like student_hidden {tuple(hs.shape)}", tuple(ht.shape))
        _check("teacher_hidden.dtype", ht.dtype == hs.dtype, f"{hs.dtype} like student_hidden", ht.dtype)
        ht = ht.detach()
    _check(
        "weights",
        weights.shape == (n,) and weights.is_floating_point(),
        f"a floating [{n}] tensor",
        f"{tuple(weights.shape)} {weights.dtype}",
    )
    _check(
        "weights",
        bool(torch.isfinite(weights).all()) and bool((weights >= 0).all()),
        "finite and >= 0",
        f"min {weights.min().item() if n else 0}",
    )
    if label_source == "data":
        _check(
            "labels",
            labels is not None and labels.shape == (n,) and not labels.is_floating_point(),
            f"an integer [{n}] tensor",
            None if labels is None else f"{tuple(labels.shape)} {labels.dtype}",
        )
        valid = labels[weights > 0]
        _check(
            "labels",
            valid.numel() == 0 or (int(valid.min()) >= 0 and int(valid.max()) < vocab),
            f"token ids in [0, {vocab}) where weight > 0",
            f"range [{int(valid.min())}, {int(valid.max())}]" if valid.numel() else None,
        )
    if slot_ids is not None:
        _check("num_slots", num_slots is not None and num_slots >= 1, "given with slot_ids", num_slots)
        _check(
            "slot_ids",
            slot_ids.shape == (n,) and (n == 0 or (int(slot_ids.min()) >= 0 and int(slot_ids.max()) < num_slots)),
            f"[{n}] ids in [0, {num_slots})",
            tuple(slot_ids.shape),
        )
    terms = LossTerms(kl_weight, temperature, cap_weight, cap_temperature, label_source, logit_scale, softcap)
    chunk = chunk_rows(vocab, chunk_size, memory_budget)

    keep = (weights > 0).nonzero().squeeze(1)  # compaction: weight-0 rows cost nothing
    hs_k = hs.index_select(0, keep)  # differentiable: backward scatters into [N, H]
    ht_k = ht.index_select(0, keep) if ht is not None else None
    y_k = labels.index_select(0, keep).long() if label_source == "data" else None
    w_k = weights.index_select(0, keep)
    slots_k = slot_ids.index_select(0, keep).long() if slot_ids is not None else None
    groups = num_slots if slot_ids is not None else None
    if keep.numel() == 0:
        loss = hs.sum().to(torch.promote_types(hs.dtype, torch.float32)) * 0.0
        stats = torch.zeros(groups or 1, 7, dtype=torch.float64, device=hs.device)
    elif torch.is_grad_enabled() and hs.requires_grad:
        loss, stats = _FusedDraftLoss.apply(hs_k, ht_k, w_head.detach(), y_k, w_k, slots_k, groups, terms, chunk)
    else:  # no_grad / inference: no gradient work at all
        loss, stats, _ = _run_chunks(hs_k, ht_k, w_head, y_k, w_k, slots_k, groups, terms, chunk, False)
        loss = loss.to(torch.promote_types(hs.dtype, torch.float32))
    return loss, _metrics(stats, ht is not None, slot_ids is not None)


_COLUMNS = ("rows", "ce", "kl", "entropy", "correct", "agreement", "label_prob")


def _metrics(stats: torch.Tensor, has_teacher: bool, per_slot: bool) -> dict:
    def summarize(s: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = s[..., 0].clamp(min=1)
        out = {
            "rows": s[..., 0],
            "correct": s[..., 4],
            "ce": s[..., 1] / rows,
            "kl": s[..., 2] / rows,
            "cap": s[..., 3] / s[..., 4].clamp(min=1),
            "accuracy": s[..., 4] / rows,
            "label_prob": s[..., 6] / rows,
        }
        if has_teacher:
            out["agreement"] = s[..., 5] / rows
        return out

    metrics = summarize(stats.sum(0))
    if per_slot:
        metrics["per_slot"] = summarize(stats)
    return metrics
