"""The chunk epilogue as a Triton kernel: the CUDA twin of the native CPU kernel (``kernels/chunk_epilogue.cpp``).

One program per row of the chunk walks the row's ``V`` logits in blocks, three times:

    pass 1  raw logits (head dtype) -> transformed z (scale, softcap), row max and first argmax
    pass 2  e = exp(z - max) for the student and the teacher: the sums every loss term needs; with a
            gradient and an fp32 head, e^d is written into ``g`` and e^u over the teacher's raw logits
            (read no more)
    pass 3  G w.r.t. the raw logits, written into ``g`` in the head dtype: from the stored e (fp32
            head), or from exponentials computed again (bf16 head)

With an fp32 head each logit costs one exponential per distribution (plus one for T != 1 in passes 2
and 3, one for Tc != 1 in pass 2), like the native kernel; with a bf16 head two, because the e would
have to be stored in bf16, and G = coef (p - a q) loses about 1% of its largest value to that rounding
where p and q nearly cancel (measured against the native kernel, which keeps them in fp32 scratch: a
GPU row of 248K logits has no room in fast memory). Inductor's kernel recomputes them in every pass:
four or more per logit with KL. Values are cast to fp32 right after each load: all arithmetic is fp32
(bf16 arithmetic is also what Triton's CPU interpreter gets wrong). A softcap's tanh is computed from
one exponential in every pass that reads the logits. The math is ``fused._chunk_epilogue`` + ``_row_terms``; tests compare it with the float64
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
    a, temp, tc, scale, cap, inv_cap,
    HAS_TEACHER: tl.constexpr, DATA_LABELS: tl.constexpr, KL: tl.constexpr, TEMPERED: tl.constexpr,
    CAP_TEMPERED: tl.constexpr, SOFTCAP: tl.constexpr, GRAD: tl.constexpr, STORE_E: tl.constexpr,
    BLOCK: tl.constexpr,
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
    # s5 = sum e^(d/T); s6 = sum e^(d/Tc), s7 = sum e^(d/Tc) d  (d = z - m_s, u = (zt - m_t) / T)
    s0 = tl.zeros([BLOCK], tl.float32)
    s1 = tl.zeros([BLOCK], tl.float32)
    s2 = tl.zeros([BLOCK], tl.float32)
    s3 = tl.zeros([BLOCK], tl.float32)
    s4 = tl.zeros([BLOCK], tl.float32)
    s5 = tl.zeros([BLOCK], tl.float32)
    s6 = tl.zeros([BLOCK], tl.float32)
    s7 = tl.zeros([BLOCK], tl.float32)
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
        if KL:
            zt = _transformed(tl.load(zt_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
            u = tl.where(inside, (zt - m_t) * inv_t, 0.0)
            q = tl.where(inside, tl.exp(u), 0.0)
            s2 += q
            s3 += q * u
            s4 += q * d
            if GRAD and STORE_E:  # the teacher's raw logits are not read again: their buffer keeps e^u
                tl.store(zt_row + offs, q, mask=inside)
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
    tl.store(out_ptr + row * 4 + 0, lse)
    tl.store(out_ptr + row * 4 + 1, z_y)
    tl.store(out_ptr + row * 4 + 2, entropy)
    tl.store(out_ptr + row * 4 + 3, kl)
    tl.store(arg_ptr + row * 2 + 0, s_arg.to(tl.int64))
    tl.store(arg_ptr + row * 2 + 1, t_arg.to(tl.int64))

    if GRAD:
        # G = coef [ (1-a)(p - e_y) + a T (p^T - q) ] * dz/draw; at T = 1: coef (p - a q) - coef (1-a) e_y
        c = tl.load(coef_ptr + row).to(tl.float32)
        if TEMPERED:
            k_p = c * (1.0 - a) / t0
        else:
            k_p = c / t0
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
                v = k_p * tl.load(g_ptr + row * V + offs, mask=inside, other=0.0)
            else:
                v = k_p * tl.exp(z - m_s)
            if KL:
                if STORE_E:
                    v -= k_q * tl.load(zt_row + offs, mask=inside, other=0.0)
                else:
                    zt = _transformed(tl.load(zt_row + offs, mask=inside, other=0.0), scale, inv_cap, cap, SOFTCAP)
                    v -= k_q * tl.exp((zt - m_t) * inv_t)
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


def chunk_epilogue(zs_raw, zt_raw, y, coef, g_out, kl_weight, temperature, cap_temperature, logit_scale, softcap):
    """Row terms ``(lse, z_y, s_arg, t_arg, entropy, kl)`` ``[c]`` of a chunk, and G in ``g_out``:
    ``native.chunk_epilogue``'s contract. An fp32 ``zt_raw`` is overwritten when there is a gradient and KL.

    ``zs_raw``/``zt_raw`` ``[c, V]`` raw logits (bf16 or fp32, contiguous; ``zt_raw`` may be None), ``y``
    ``[c]`` data labels or None (teacher labels), ``coef`` ``[c]`` fp32 = w / sum w, ``g_out`` ``[c, V]``
    head dtype or None."""
    c, vocab = zs_raw.shape
    tensors = [x for x in (zs_raw, zt_raw, g_out) if x is not None]
    if zs_raw.dtype not in DTYPES or not all(x.is_contiguous() and x.dtype == zs_raw.dtype for x in tensors):
        raise ValueError("triton chunk_epilogue: contiguous bf16 or fp32 logits and G of one dtype are required")
    kl_on = zt_raw is not None and kl_weight > 0
    out = torch.empty(c, 4, dtype=torch.float32, device=zs_raw.device)
    args = torch.empty(c, 2, dtype=torch.int64, device=zs_raw.device)
    if c == 0:
        return (*out.unbind(1)[:2], args[:, 0], None, *out.unbind(1)[2:])
    dummy = zs_raw  # never read where a flag is off
    _chunk_kernel[(c,)](
        zs_raw, zt_raw if zt_raw is not None else dummy,
        y.to(torch.int64).contiguous() if y is not None else args, coef.to(torch.float32).contiguous(),
        g_out if g_out is not None else dummy, out, args, vocab,
        float(kl_weight), float(temperature), float(cap_temperature), float(logit_scale),
        float(softcap or 1.0), 1.0 / float(softcap or 1.0),
        HAS_TEACHER=zt_raw is not None, DATA_LABELS=y is not None, KL=kl_on, TEMPERED=kl_on and temperature != 1.0,
        CAP_TEMPERED=cap_temperature != 1.0, SOFTCAP=bool(softcap), GRAD=g_out is not None,
        STORE_E=zs_raw.dtype == torch.float32, BLOCK=BLOCK,
    )  # fmt: skip
    lse, z_y, entropy, kl = out.unbind(1)
    return lse, z_y, args[:, 0], (args[:, 1] if zt_raw is not None else None), entropy, kl
