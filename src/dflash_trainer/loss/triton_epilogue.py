"""The chunk epilogue as a Triton kernel: the CUDA twin of the native CPU kernel (``kernels/chunk_epilogue.cpp``).

One program per row of the chunk walks the row's ``V`` logits in blocks, three times:

    pass 1  raw logits (head dtype) -> transformed z (scale, softcap), row max and first argmax
    pass 2  e = exp(z - max) for the student and the teacher: the sums every loss term needs; with a
            gradient and an fp32 head, e^d is written into ``g`` and e^u over the teacher's raw logits
            (read no more)
    pass 3  G w.r.t. the raw logits, written into ``g`` in the head dtype: from the stored e (fp32
            head), or from exponentials computed again (bf16 head)

The pair statistics (``PER_ROW``: overlap and Renyi-1/2, any caller's pair terms) add the teacher at T = 1 to pass 2 (its normalizer and the
Bhattacharyya sum ``sum sqrt(e^d e^u1)``; with KL at T = 1 that is e^u itself), one pass between 2 and
3 for the acceptance ``sum min(p, q)`` (it needs both normalizers; from the stored e where there are
any, else exponentials again), and the Renyi-1/2 gradient in pass 3. With KL at T != 1 the teacher's
raw logits are then kept (pass 3 needs them at T = 1) and e^u is computed again in pass 3.

With an fp32 head each logit costs one exponential per distribution (plus one for T != 1 in passes 2
and 3, one for Tc != 1 in pass 2), like the native kernel; with a bf16 head two, because the e would
have to be stored in bf16, and G = coef (p - a q) loses about 1% of its largest value to that rounding
where p and q nearly cancel (measured against the native kernel, which keeps them in fp32 scratch: a
GPU row of 248K logits has no room in fast memory). Inductor's kernel recomputes them in every pass:
four or more per logit with KL. Values are cast to fp32 right after each load: all arithmetic is fp32
(bf16 arithmetic is also what Triton's CPU interpreter gets wrong). A softcap's tanh is computed from
one exponential in every pass that reads the logits. The math is ``eager.eager_chunk``'s; tests compare it with the float64
reference and with the native kernel under ``TRITON_INTERPRET=1``, which must be set before this module
is imported (``triton.jit`` reads it when it decorates).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.bfloat16, torch.float32)  # heads the kernel takes; row results are fp32
BLOCK = 1024  # logits per step of a row's loop


@triton.jit
def _transformed(raw, scale, inv_cap, cap, SOFTCAP: tl.constexpr):
    z = raw.to(tl.float32) * scale
    if SOFTCAP:  # cap * tanh(z / cap), tanh through exp (no tanh in every Triton release)
        x = z * inv_cap
        z = cap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
    return z


@triton.jit
def _row_max(ptr, V, scale, inv_cap, cap, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """Row maximum of the transformed logits and the index of its first occurrence."""
    m = -float("inf")
    arg = 0
    for b0 in range(0, V, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        z = _transformed(tl.load(ptr + offs, mask=offs < V, other=0.0), scale, inv_cap, cap, SOFTCAP)
        z = tl.where(offs < V, z, -float("inf"))
        bm = tl.max(z, 0)
        barg = tl.min(tl.where(z == bm, offs, V), 0)  # first index of the block maximum
        arg = tl.where(bm > m, barg, arg)
        m = tl.maximum(m, bm)
    return m, arg


@triton.jit
def _chunk_kernel(
    zs_ptr, zt_ptr, y_ptr, coef_ptr, g_ptr, out_ptr, arg_ptr, V,
    a, temp, tc, scale, cap, inv_cap, beta,
    HAS_TEACHER: tl.constexpr, DATA_LABELS: tl.constexpr, KL: tl.constexpr, TEMPERED: tl.constexpr,
    CAP_TEMPERED: tl.constexpr, SOFTCAP: tl.constexpr, GRAD: tl.constexpr, STORE_E: tl.constexpr,
    STORE_Q: tl.constexpr, PER_ROW: tl.constexpr, RENYI: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    zs_row = zs_ptr + row * V
    zt_row = zt_ptr + row * V
    m_s, s_arg = _row_max(zs_row, V, scale, inv_cap, cap, SOFTCAP, BLOCK)
    m_t = 0.0
    t_arg = -1
    if HAS_TEACHER:
        m_t, t_arg = _row_max(zt_row, V, scale, inv_cap, cap, SOFTCAP, BLOCK)
    if DATA_LABELS:
        y = tl.load(y_ptr + row)
    else:
        y = t_arg.to(tl.int64)
    z_y = _transformed(tl.load(zs_row + y), scale, inv_cap, cap, SOFTCAP)
    inv_t = 1.0 / temp
    inv_tc = 1.0 / tc

    # pass 2: s0 = sum e^d, s1 = sum e^d d; s2 = sum e^u, s3 = sum e^u u, s4 = sum e^u d;
    # s5 = sum e^(d/T); s6 = sum e^(d/Tc), s7 = sum e^(d/Tc) d  (d = z - m_s, u = (zt - m_t) / T);
    # s8 = sum e^u1, s9 = sum sqrt(e^d e^u1)  (per-row terms: u1 = zt - m_t, the teacher at T = 1)
    s0 = tl.zeros([BLOCK], tl.float32)
    s1 = tl.zeros([BLOCK], tl.float32)
    s2 = tl.zeros([BLOCK], tl.float32)
    s3 = tl.zeros([BLOCK], tl.float32)
    s4 = tl.zeros([BLOCK], tl.float32)
    s5 = tl.zeros([BLOCK], tl.float32)
    s6 = tl.zeros([BLOCK], tl.float32)
    s7 = tl.zeros([BLOCK], tl.float32)
    s8 = tl.zeros([BLOCK], tl.float32)
    s9 = tl.zeros([BLOCK], tl.float32)
    for b0 in range(0, V, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        inside = offs < V
        d = _transformed(tl.load(zs_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP) - m_s
        d = tl.where(inside, d, 0.0)
        e = tl.where(inside, tl.exp(d), 0.0)
        s0 += e
        s1 += e * d
        if GRAD and STORE_E:
            tl.store(g_ptr + row * V + offs, e, mask=inside)
        if KL or PER_ROW:
            zt = _transformed(tl.load(zt_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
        if KL:
            u = tl.where(inside, (zt - m_t) * inv_t, 0.0)
            q = tl.where(inside, tl.exp(u), 0.0)
            s2 += q
            s3 += q * u
            s4 += q * d
            if STORE_Q:  # the teacher's raw logits are not read again: their buffer keeps e^u
                tl.store(zt_row + offs, q, mask=inside)
        if PER_ROW:
            if KL and not TEMPERED:
                q1 = q
            else:
                q1 = tl.where(inside, tl.exp(zt - m_t), 0.0)
                s8 += q1
            s9 += tl.sqrt(e * q1)
        if TEMPERED:
            s5 += tl.where(inside, tl.exp(d * inv_t), 0.0)
        if CAP_TEMPERED:
            ec = tl.where(inside, tl.exp(d * inv_tc), 0.0)
            s6 += ec
            s7 += ec * d
    t0 = tl.sum(s0, 0)
    log_sum = tl.log(t0)
    lse = m_s + log_sum
    if CAP_TEMPERED:
        t6 = tl.sum(s6, 0)
        entropy = tl.log(t6) - tl.sum(s7, 0) / (tc * t6)
    else:
        entropy = log_sum - tl.sum(s1, 0) / t0
    kl = 0.0
    t2 = 1.0
    t5 = 1.0
    if KL:  # KL(q^T || p^T) = (s3/s2 - log s2) - (s4 / (T s2) - log sum_T)
        t2 = tl.sum(s2, 0)
        log_sum_t = log_sum
        if TEMPERED:
            t5 = tl.sum(s5, 0)
            log_sum_t = tl.log(t5)
        kl = tl.sum(s3, 0) / t2 - tl.log(t2) - tl.sum(s4, 0) / (temp * t2) + log_sum_t
    tl.store(out_ptr + row * 6 + 0, lse)
    tl.store(out_ptr + row * 6 + 1, z_y)
    tl.store(out_ptr + row * 6 + 2, entropy)
    tl.store(out_ptr + row * 6 + 3, kl)
    t9 = 1.0
    if PER_ROW:  # acceptance sum min(p, q1) from both normalizers; Renyi -2 log BC, BC = s9 / sqrt(s0 sum_t1)
        if KL and not TEMPERED:
            t8 = tl.sum(s2, 0)
        else:
            t8 = tl.sum(s8, 0)
        t9 = tl.sum(s9, 0)
        acc = tl.zeros([BLOCK], tl.float32)
        for b0 in range(0, V, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            inside = offs < V
            if STORE_E:
                e = tl.load(g_ptr + row * V + offs, mask=inside, other=0.0)
            else:
                z = _transformed(tl.load(zs_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
                e = tl.where(inside, tl.exp(z - m_s), 0.0)
            if STORE_Q:
                q1 = tl.load(zt_row + offs, mask=inside, other=0.0)
            else:
                zt = _transformed(tl.load(zt_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
                q1 = tl.where(inside, tl.exp(zt - m_t), 0.0)
            acc += tl.minimum(e / t0, q1 / t8)
        tl.store(out_ptr + row * 6 + 4, tl.sum(acc, 0))
        tl.store(out_ptr + row * 6 + 5, -2.0 * tl.log(t9) + log_sum + tl.log(t8))
    tl.store(arg_ptr + row * 2 + 0, s_arg.to(tl.int64))
    tl.store(arg_ptr + row * 2 + 1, t_arg.to(tl.int64))

    if GRAD:
        # G = coef [ (1-a)(p - e_y) + a T (p^T - q) ] * dz/draw; at T = 1: coef (p - a q) - coef (1-a) e_y
        c = tl.load(coef_ptr + row).to(tl.float32)
        if TEMPERED:
            k_p = c * (1.0 - a) / t0
        else:
            k_p = c / t0
        k_r = 0.0
        if RENYI:  # beta (p - sqrt(p q1) / BC): the p part joins k_p; sqrt(p q1) / BC = sqrt(e^d e^u1) / s9
            k_p += c * beta / t0
            k_r = c * beta / t9
        k_q = 0.0
        if KL:
            if TEMPERED:
                k_q = c * a * temp / t2
            else:
                k_q = c * a / t2
        k_pt = c * a * temp / t5
        label = c * (1.0 - a)
        for b0 in range(0, V, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            inside = offs < V
            if TEMPERED or SOFTCAP or not STORE_E:
                z = _transformed(tl.load(zs_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
            if STORE_E:
                e = tl.load(g_ptr + row * V + offs, mask=inside, other=0.0)
            else:
                e = tl.exp(z - m_s)
            v = k_p * e
            if (KL and not STORE_Q) or RENYI:
                zt = _transformed(tl.load(zt_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
            if KL:
                if STORE_Q:
                    q = tl.load(zt_row + offs, mask=inside, other=0.0)
                else:
                    q = tl.exp((zt - m_t) * inv_t)
                v -= k_q * q
            if RENYI:
                if KL and not TEMPERED:
                    q1 = q
                else:
                    q1 = tl.exp(zt - m_t)
                v -= k_r * tl.sqrt(e * q1)
            if TEMPERED or SOFTCAP:
                if TEMPERED:
                    v += k_pt * tl.exp((z - m_s) * inv_t)
            v = tl.where(offs == y, v - label, v)
            if SOFTCAP:
                r = z * inv_cap
                v = v * (scale * (1.0 - r * r))
            else:
                v = v * scale
            tl.store(g_ptr + row * V + offs, v.to(g_ptr.dtype.element_ty), mask=inside)


def chunk_epilogue(zs_raw, zt_raw, y, coef, g_out, t):
    """Row terms ``(lse, z_y, s_arg, t_arg, entropy, kl)`` ``[c]`` of a chunk for the terms ``t``
    (``loss.terms.LossTerms``; then ``(overlap, renyi_half)`` with ``t.pair_statistics``), and G in
    ``g_out``: ``native.chunk_epilogue``'s contract. An fp32 ``zt_raw`` is overwritten when there is a
    gradient and KL (unless the pair statistics are on with T != 1).

    ``zs_raw``/``zt_raw`` ``[c, V]`` raw logits (bf16 or fp32, contiguous; ``zt_raw`` may be None), ``y``
    ``[c]`` data labels or None (teacher labels), ``coef`` ``[c]`` fp32 = w / sum w, ``g_out`` ``[c, V]``
    head dtype or None."""
    kl_weight, temperature, cap_temperature = t.kl_weight, t.temperature, t.cap_temperature
    logit_scale, softcap, per_row = t.logit_scale, t.softcap, t.pair_statistics
    renyi_weight = t.gradient_weight("renyi_half")
    c, vocab = zs_raw.shape
    tensors = [x for x in (zs_raw, zt_raw, g_out) if x is not None]
    if zs_raw.dtype not in DTYPES or not all(x.is_contiguous() and x.dtype == zs_raw.dtype for x in tensors):
        raise ValueError("triton chunk_epilogue: contiguous bf16 or fp32 logits and G of one dtype are required")
    if per_row and zt_raw is None:
        raise ValueError("triton chunk_epilogue: the pair statistics need the teacher's logits")
    kl_on = zt_raw is not None and kl_weight > 0
    tempered = kl_on and temperature != 1.0
    store_e = g_out is not None and zs_raw.dtype == torch.float32
    out = torch.zeros(c, 6, dtype=torch.float32, device=zs_raw.device)
    args = torch.empty(c, 2, dtype=torch.int64, device=zs_raw.device)
    lse, z_y, entropy, kl, accept, renyi = out.unbind(1)
    if c == 0:
        rows = (lse, z_y, args[:, 0], None, entropy, kl)
        return (*rows, accept, renyi) if per_row else rows
    dummy = zs_raw  # never read where a flag is off
    _chunk_kernel[(c,)](
        zs_raw, zt_raw if zt_raw is not None else dummy,
        y.to(torch.int64).contiguous() if y is not None else args, coef.to(torch.float32).contiguous(),
        g_out if g_out is not None else dummy, out, args, vocab,
        float(kl_weight), float(temperature), float(cap_temperature), float(logit_scale),
        float(softcap or 1.0), 1.0 / float(softcap or 1.0), float(renyi_weight),
        HAS_TEACHER=zt_raw is not None, DATA_LABELS=y is not None, KL=kl_on, TEMPERED=tempered,
        CAP_TEMPERED=cap_temperature != 1.0, SOFTCAP=bool(softcap), GRAD=g_out is not None,
        STORE_E=store_e, STORE_Q=store_e and kl_on and not (per_row and tempered), PER_ROW=bool(per_row),
        RENYI=bool(per_row) and renyi_weight > 0 and g_out is not None, BLOCK=BLOCK,
    )  # fmt: skip
    rows = (lse, z_y, args[:, 0], (args[:, 1] if zt_raw is not None else None), entropy, kl)
    return (*rows, accept, renyi) if per_row else rows
