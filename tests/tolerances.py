"""Error bounds for comparing floating-point results, derived from the arithmetic, never measured.

Every bound here is a worst case of the standard model of floating-point arithmetic (Higham, *Accuracy
and Stability of Numerical Algorithms*, 2nd ed., chapters 2-4): each basic operation in a dtype with
unit roundoff u returns the exact result times (1 + d), |d| <= u. Worst cases hold for *any* summation
order, blocking, vector width or thread split, so they hold on every machine (AVX-512 or AVX2 only,
OpenMP or not, Triton's blocks, a different BLAS): a test bounded by one of them fails only when the
code computes something else, never because a CPU sums in another order. They are loose (the typical
error grows like sqrt(n) u, not n u), and a bug in a loss or a kernel still shows up orders of
magnitude above them (a wrong term, sign, temperature or index moves results by 1e-3 to 1, where these
bounds are 1e-4 at most for fp32 at the tests' sizes).

The rules:
- ``gamma(n, dtype) = n u / (1 - n u)``: the relative error of n chained roundings.
- a sum of n terms: ``|fl(sum x) - sum x| <= gamma(n - 1) * sum |x|``;
- a dot product of length n, or an entry of a matrix product with inner dimension n:
  ``|fl(x . y) - x . y| <= gamma(n) * sum |x_i y_i|``;
- an elementary function (exp, log, tanh, sqrt) of a library: ``ELEMENTARY_ULPS`` ulp;
- a softmax over n logits: ``softmax_error`` (below);
- a fast result F and a float64 reference R with ``|F - R| <= b_F``: two fast results compared with
  each other differ by at most ``b_F + b_G`` (``combined``).
"""

from __future__ import annotations

import torch

from dflash_trainer.loss.terms import LossTerms

_MANTISSA_BITS = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}

# Library elementary functions in float: glibc's libm and libmvec document at most 1-4 ulp for
# exp/log/tanh in binary32 (glibc manual, "Known Maximum Errors in Math Functions"), numpy's SIMD float32
# exp/log at most 2.52 / 3.83 ulp (numpy 1.20 release notes); Sleef's *_u10 functions 1 ulp.
ELEMENTARY_ULPS = 4


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a dtype with p mantissa bits (the implicit bit included): fp32 2^-24, bf16 2^-8."""
    return 2.0 ** -_MANTISSA_BITS[dtype]


def gamma(n: float, dtype: torch.dtype) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n roundings in a row."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) undefined for {dtype}: n u >= 1")
    return nu / (1 - nu)


def kernel_exp_error() -> float:
    """Relative error bound of the native kernel's float exp (kernels/chunk_epilogue.cpp, ``exp_c``):
    Horner's rule for the degree-7 Taylor polynomial at |r| <= ln2/2 rounds 14 times on sums whose
    absolute values add up to at most e^{ln2/2} < 1.42 (Higham eq. 5.3: gamma_{2n} sum |a_i| |r|^i),
    the truncation is 5e-9 relative (the kernel's comment: (ln2/2)^8/8! < 5e-9), the range reduction
    rounds twice on r (the first part of the Cody-Waite split is exact), and the scaling by 2^n once."""
    return gamma(14, torch.float32) * 1.42 + 5e-9 + gamma(3, torch.float32) * 1.42


def elementary_error(dtype: torch.dtype = torch.float32) -> float:
    """Relative error bound of a library exp/log/tanh/sqrt in ``dtype``; the native kernel's own float
    exp has a larger one (``kernel_exp_error``), so float bounds take the larger of the two."""
    if dtype == torch.float64:
        return ELEMENTARY_ULPS * unit_roundoff(dtype) * 2
    return max(ELEMENTARY_ULPS * unit_roundoff(dtype) * 2, kernel_exp_error())


def softmax_error(n: int, spread: float, dtype: torch.dtype = torch.float32) -> float:
    """Relative error bound of every probability ``p_j = exp(z_j - m) / sum_k exp(z_k - m)`` of a
    softmax over n logits computed in ``dtype`` from exact inputs, where ``spread`` bounds |z_j - m|:
    the subtraction rounds (absolute error u |z_j - m| in the exponent, so relative ``u * spread``
    in the exponential), the exponential (``elementary_error``), the sum of n positive terms
    (``gamma(n - 1)``) and the division (u), to first order in u."""
    u = unit_roundoff(dtype)
    return u * spread + elementary_error(dtype) + gamma(n - 1, dtype) + u


def log_softmax_error(n: int, spread: float, values, dtype: torch.dtype = torch.float32):
    """Bound of each log-probability ``values`` of a log-softmax over n logits computed in ``dtype``
    (``spread`` as in ``softmax_error``): the probability's relative error is, to first order, an absolute
    one on its log, plus the result's own rounding."""
    return softmax_error(n, spread, dtype) + unit_roundoff(dtype) * abs(values)


def combined(*bounds):
    """Two fast results each within its bound of the same float64 reference differ by at most the sum."""
    return sum(bounds[1:], bounds[0])


def transformed_logits(z_raw: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """The loss's logit transform in float64: ``scale z``, then ``c tanh(z / c)`` with a softcap c."""
    z = z_raw.double() * logit_scale
    return softcap * torch.tanh(z / softcap) if softcap else z


def renyi_gradient_weight(terms: LossTerms) -> float:
    """``sum weight * |scale|`` over the weighted ``renyi_half`` pair terms: beta, the Renyi weight of the bounds."""
    return sum(t.weight * abs(t.scale) for t in terms.pair_terms if t.statistic == "renyi_half" and t.weight > 0)


def epilogue_error(zs_raw, zt_raw, coef, terms: LossTerms, dtype: torch.dtype = torch.float32):
    """Bounds for a chunk epilogue (``native.chunk_epilogue``'s contract, ``terms`` a ``LossTerms``)
    computed in float from raw logits exact in the head dtype (``dtype`` float64: in double, from float64
    logits, then against the exact epilogue), against the same epilogue in float64. Returns
    ``(row_error, g_error)``: ``row_error(x64)`` bounds each row result (lse, entropy, KL, acceptance,
    Renyi) given its float64 value, ``g_error`` ``[c, 1]`` bounds every element of G before it is
    rounded to the head dtype (``g_head_error`` adds that rounding).

    Derivation: the transform (a product, a division, tanh and a product) puts an absolute error of at
    most ``(3u + elementary) |z|`` on each logit, i.e. a relative one of twice that on an exponential of
    a difference of two logits, divided by the temperature; each probability of the student, the teacher,
    tempered or not, then carries at most ``delta = softmax_error(V, spread / T_min) + that + 4u`` (4u:
    the products that combine it into G). G is ``coef [(1-a)(p - e_y) + a T (p^T - q^T) + beta (p -
    sqrt(p q) / BC)]`` times the transform's derivative (at most the logit scale): a weighted sum of
    terms at most 1 in magnitude (sqrt(p_j q_j) <= BC), so ``|dG| <= coef |s| (M delta + 4u (M + 1))``
    with ``M = (1-a) + 2aT + 3 beta``. Each row result is a sum over V of products of at most two
    probabilities and a logit (or log-probability) bounded by ``|x| + spread``: ``4 delta (1 + |x| +
    spread)`` covers it, and the acceptance and Renyi terms (sums of min(p, q), -2 log of a sum of
    sqrt(p q)) are within that too."""
    kl_weight, temperature, cap_temperature = terms.kl_weight, terms.temperature, terms.cap_temperature
    logit_scale, softcap, renyi_weight = terms.logit_scale, terms.softcap, renyi_gradient_weight(terms)
    u = unit_roundoff(dtype)
    t_min = min(1.0, temperature, cap_temperature)
    zs = transformed_logits(zs_raw, logit_scale, softcap)
    logits = [zs] + ([transformed_logits(zt_raw, logit_scale, softcap)] if zt_raw is not None else [])
    vocab = zs.shape[-1]
    zmax = torch.stack([z.abs().amax(-1) for z in logits]).amax(0)  # [c]
    spread = torch.stack([z.amax(-1) - z.amin(-1) for z in logits]).amax(0) / t_min  # [c]
    transform = (3 * u + elementary_error(dtype)) * zmax * 2 / t_min
    delta = softmax_error(vocab, spread, dtype) + transform + 4 * u  # [c]
    m = (1 - kl_weight) + 2 * kl_weight * temperature + 3 * renyi_weight
    g_error = (coef.double().abs() * abs(logit_scale) * (m * delta + 4 * u * (m + 1)))[:, None]

    def row_error(x64: torch.Tensor) -> torch.Tensor:
        return 4 * delta * (1 + x64.abs() + spread)

    return row_error, g_error


def g_head_error(g_error: torch.Tensor, g64: torch.Tensor, head_dtype: torch.dtype, truncating=False) -> torch.Tensor:
    """``g_error`` plus the final rounding of G to the head dtype: ``u_head (|G| + g_error)`` to nearest
    (none for fp32), twice that for a conversion that truncates (Triton's CPU interpreter converts fp32
    to bf16 toward zero: ``_convert_float`` rounds to nearest only when asked, and ``.to()`` does not)."""
    if head_dtype == torch.float32:
        return g_error
    u = unit_roundoff(head_dtype) * (2 if truncating else 1)
    return g_error * (1 + u) + u * g64.abs()


def fused_loss_error(
    hs, ht, w_head, labels, weights, dtype, terms: LossTerms | None = None, *, bias_rows=None, bias_weight=None,
    block_ids=None,
):  # fmt: skip
    """Bounds for the fused draft loss with ``terms`` (a ``LossTerms``; its call keywords: the low-rank
    bias and the block ids) computed from the float64 inputs rounded to ``dtype`` (fp32, or bf16 with
    fp32 logits), against the float64 reference on the float64 inputs; for ``dtype`` float64, computed
    in float64 against the exact value, so two float64 evaluations differ by at most twice the bounds.
    Returns ``(loss_error, grad_error, term_error)``: the loss's absolute error, an elementwise
    ``[N, H]`` bound on the gradient of ``hs`` (before its own rounding to ``dtype``), and the bound of
    a metric that averages one per-row term (CE, KL, CAP's entropy). Magnitudes come from the float64
    distributions.

    Derivation (the rules of the module docstring):
    - logits: rounding h and W to ``dtype`` (u_d each), the GEMM (gamma_H, fp32 accumulation) and for a
      bf16 head the logits' own rounding (u_d |z|) put at most ``dz_i = (3 u_d + gamma_H) max_v (|W|
      |h_i|)_v`` on each logit of row i (student or teacher);
    - probabilities: each of row i (student, teacher, tempered or not) is within a relative ``delta_i =
      2 |s| dz_i / T_min + u spread_i + exp + gamma_{V-1} + u + transform + 4u`` (the logit scale s;
      the shifted logits' rounding; the exponential; the sum; the division; the transform of
      ``epilogue_error``; the products that combine them);
    - row terms: CE = lse - z_y, KL and the CAP entropy are sums of probabilities times their logs, so
      each is within ``4 delta_i (1 + |x_i|)`` of its float64 value x_i, plus u |lse_i| for the shift;
    - the loss weights them by ``coef = w / sum w`` ((1-a) CE + a T^2 KL + beta Renyi), CAP's entropy by
      ``cap_weight`` over its rows, and its final sums round (gamma_N, and the weights' rounding 2 u_d,
      on the sum of the absolute values);
    - gradient: G's element v of row i is ``coef_i [(1-a)(p_v - e_y) + a T (p^T_v - q^T_v) + beta (p_v -
      sqrt(p_v q_v)/BC)]`` plus CAP's ``cap_weight / (n_c Tc) pc_v (log pc_v + H)``, times the
      transform's derivative (at most |s|); each part is within delta_i of itself, so ``|dG_iv| <=
      delta_i Gabs_iv`` (Gabs: the sum of the parts' absolute values), and ``dh = G W`` adds the GEMM
      over V (gamma_V) and W's rounding (u_d): ``|d dh_i| <= (delta_i + gamma_V + 2 u_d) |s| (Gabs_i
      |W|)``;
    - DSpark's Markov bias ``e_i . w2_v`` joins the logits (its GEMM over r: gamma_r |e| |w2| on dz), and
      its gradients are GEMMs of G like dh: ``de = G w2`` over V, ``dw2 = G^T e`` over N;
    - D-PARD's coefficients ``W_t / n = sum_{k>=t} prod_{i<=k} s_i / n``, ``s_i = alpha + (1-alpha)
      a_i``, have each acceptance within 4 delta (a sum of min(p, q)), so each factor within
      ``4 delta / alpha`` relatively and a block's coefficients within ``B 4 delta_max / alpha +
      gamma_B`` (B factors, B sums); that relative error scales every term of the loss and of G.
    - D-PACE's coefficients are the same credit of ``s_i = alpha + (1-alpha) p_i(y_i)``: each label
      probability within delta_i relatively, so each factor within ``delta / alpha``, a block's
      coefficients within ``B delta_max / alpha + gamma_2B``;
    - TV ``1 - a_i`` is within 4 delta_i + u (a's bound, the subtraction); its gradient ``p_v (S - m_v)``,
      ``m_v = [p_v < q_v]``, ``S = sum m_u p_u``, is within delta_i of ``p_v S + m_v p_v``, except where
      p_v and q_v are within 2 delta of each other and the mask can flip: there the bound takes p_v
      (the flipped mask) on element v and p_v S's change, ``p_v p_u``, on every element u of the row.
      A weighted pair term ``offset + scale x`` (x the overlap a or the Renyi value) takes its
      statistic's bounds times ``|scale|`` (TV: scale -1, offset 1; Renyi: scale 1, offset 0).

    Returns ``(loss_error, grad_error, term_error)``, with a bias ``(loss_error, (grad_error,
    e_error, w2_error), term_error)``."""
    t = LossTerms() if terms is None else terms
    kl_weight, temperature, cap_weight, cap_temperature = t.kl_weight, t.temperature, t.cap_weight, t.cap_temperature
    logit_scale, softcap, label_source = t.logit_scale, t.softcap, t.label_source
    dpard = t.credit is not None and t.credit.confidence == "overlap"  # D-PARD's credit
    dpace = t.credit is not None and t.credit.confidence == "label_prob"  # D-PACE's
    dpard_alpha = dpace_alpha = t.credit.alpha if t.credit is not None else 0.5
    weighted = [term for term in t.pair_terms if term.weight > 0]
    # the arithmetic's dtype: fp32 logits and sums for fp32 and bf16 inputs, float64 for float64
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    u_d, u = unit_roundoff(dtype), unit_roundoff(acc)
    hs, ht, w_head, weights = (x.detach().double() for x in (hs, ht, w_head, weights))
    n, h = hs.shape
    vocab = w_head.shape[0]
    a, temp, tc = kl_weight, temperature, cap_temperature
    t_min = min(1.0, temp, tc)
    z_error = [(3 * u_d + gamma(h, acc)) * (x.abs() @ w_head.abs().T).amax(-1) for x in (hs, ht)]
    dz = torch.maximum(*z_error)  # [N]
    bias = 0.0
    if bias_rows is not None:
        e, w2 = bias_rows.detach().double(), bias_weight.detach().double()
        bias = e @ w2.T  # [N, V], the student's only
        dz = dz + (3 * u_d + gamma(e.shape[1], acc)) * (e.abs() @ w2.abs().T).amax(-1)
    coef = weights / weights.sum()
    zs = transformed_logits(hs @ w_head.T + bias, logit_scale, softcap)  # [N, V]
    zt = transformed_logits(ht @ w_head.T, logit_scale, softcap)
    zmax = torch.maximum(zs.abs().amax(-1), zt.abs().amax(-1))
    spread = torch.maximum(zs.amax(-1) - zs.amin(-1), zt.amax(-1) - zt.amin(-1)) / t_min
    transform = (3 * u + elementary_error(acc)) * zmax * 2 / t_min
    delta = 2 * abs(logit_scale) * dz / t_min + softmax_error(vocab, spread, acc) + transform + 4 * u  # [N]

    y = zt.argmax(-1) if label_source == "teacher" else labels
    lse = torch.logsumexp(zs, -1)
    ce = lse - zs.gather(1, y[:, None]).squeeze(1)
    p, p_t, q_t = zs.softmax(-1), (zs / temp).softmax(-1), (zt / temp).softmax(-1)
    kl = (q_t * (q_t.clamp_min(1e-300).log() - (zs / temp).log_softmax(-1))).sum(-1)
    log_pc = (zs / tc).log_softmax(-1)
    entropy = -(log_pc.exp() * log_pc).sum(-1)
    live = weights > 0
    correct = live & (zs.argmax(-1) == y)
    n_c = max(int(correct.sum()), 1)

    def term(x):
        return 4 * delta * (1 + x.abs())

    coef_rel = torch.zeros_like(coef)  # relative error of each row's coefficient
    if dpard:
        accept = torch.minimum(p, zt.softmax(-1)).sum(-1)
        s_acc = dpard_alpha + (1 - dpard_alpha) * accept
        ids = live.nonzero().squeeze(1).tolist()
        credit = torch.zeros_like(coef)
        longest = 1
        for i in ids:
            same = [j for j in ids if block_ids[j] == block_ids[i]]
            longest = max(longest, len(same))
            for k in (j for j in same if j >= i):
                credit[i] += torch.prod(s_acc[[j for j in same if j <= k]])
        coef = credit / len(ids)
        coef_rel = coef_rel + longest * 4 * delta[live].max() / dpard_alpha + gamma(longest, acc)
    if dpace:
        s_conf = dpace_alpha + (1 - dpace_alpha) * torch.exp(-ce)
        ids = live.nonzero().squeeze(1).tolist()
        credit = torch.zeros_like(coef)
        longest = 1
        for i in ids:
            same = [j for j in ids if block_ids[j] == block_ids[i]]
            longest = max(longest, len(same))
            for k in (j for j in same if j >= i):
                credit[i] += torch.prod(s_conf[[j for j in same if j <= k]])
        coef = credit / len(ids)
        coef_rel = coef_rel + longest * delta[live].max() / dpace_alpha + gamma(2 * longest, acc)

    parts = (1 - a) * (term(ce) + u * lse.abs()) + a * temp**2 * term(kl)
    rows_abs = (1 - a) * ce.abs() + a * temp**2 * kl.abs()
    loss_error = (coef * (parts + coef_rel * rows_abs)).sum() + cap_weight * term(entropy)[correct].sum() / n_c
    magnitude = (coef * ((1 - a) * ce.abs() + a * temp**2 * kl.abs())).sum() + cap_weight * entropy[correct].mean()
    loss_error = loss_error + (gamma(n, acc) + 2 * u_d) * magnitude

    g_abs = (1 - a) * (p + torch.nn.functional.one_hot(y, vocab)) + a * temp * (p_t + q_t)
    for pair in (x for x in weighted if x.statistic == "renyi_half"):  # Renyi-1/2 (scale 1, offset 0)
        q1 = zt.softmax(-1)
        root = (p * q1).sqrt()
        g_abs = g_abs + pair.weight * abs(pair.scale) * (p + root / root.sum(-1, keepdim=True))
        renyi = -2 * root.sum(-1).log()
        value = pair.offset + pair.scale * renyi
        loss_error = loss_error + pair.weight * (coef * (abs(pair.scale) * term(renyi) + coef_rel * value.abs())).sum()
    for pair in (x for x in weighted if x.statistic == "overlap"):  # TV = 1 - a (scale -1, offset 1)
        q1 = zt.softmax(-1)
        accept = torch.minimum(p, q1).sum(-1)
        value = pair.offset + pair.scale * accept
        loss_error = (
            loss_error + pair.weight * (coef * (abs(pair.scale) * 4 * delta + u + coef_rel * value.abs())).sum()
        )
        mp = torch.where(p < q1, p, torch.zeros_like(p))
        near = (p - q1).abs() <= 2 * delta[:, None] * torch.maximum(p, q1)
        flip = torch.where(near, p, torch.zeros_like(p))
        mask_terms = p * mp.sum(-1, keepdim=True) + mp + flip + p * flip.sum(-1, keepdim=True)
        g_abs = g_abs + pair.weight * abs(pair.scale) * mask_terms
    g_abs = coef[:, None] * g_abs
    pc = log_pc.exp()
    cap = cap_weight / (n_c * tc) * pc * (log_pc.abs() + entropy[:, None] + 2)
    g_abs = g_abs + torch.where(correct[:, None], cap, torch.zeros_like(cap))
    g_abs = g_abs * live[:, None]
    g_rel = (delta + coef_rel + gamma(vocab, acc) + 2 * u_d)[:, None] * abs(logit_scale)
    grad_error = g_rel * (g_abs @ w_head.abs())
    # a metric that is a weighted mean of one per-row term (CE, KL, the CAP entropy): the worst row's
    # bound plus the mean's own rounding
    worst = torch.stack([term(ce), term(kl), term(entropy)])[:, live].amax()
    term_error = worst + (gamma(n, acc) + 2 * u_d) * torch.stack([ce, kl, entropy])[:, live].abs().amax()
    if bias_rows is not None:
        e_error = g_rel * (g_abs @ w2.abs())
        w2_error = (delta.max() + coef_rel.max() + gamma(n, acc) + 2 * u_d) * abs(logit_scale) * (g_abs.T @ e.abs())
        grad_error = (grad_error, e_error, w2_error)
    return loss_error.item(), grad_error, term_error.item()


def fused_loss_float64_apart(hs, ht, w_head, labels, weights, terms: LossTerms, **keywords):
    """``(loss, gradient, averaged term)`` bounds between two float64 evaluations of the fused loss in
    different orders (the fused path in chunks, the reference, another chunking): each is within
    ``fused_loss_error`` at float64 of the exact value, so they are within the sum of two (``combined``);
    ``keywords``: the loss's bias and block ids, with which the gradient bound is a tuple (h, e, W2)."""
    loss_error, grad_error, term_error = fused_loss_error(
        hs, ht, w_head, labels, weights, torch.float64, terms, **keywords
    )
    if isinstance(grad_error, tuple):
        grad_apart = tuple(combined(g, g) for g in grad_error)
    else:
        grad_apart = combined(grad_error, grad_error)
    return combined(loss_error, loss_error), grad_apart, combined(term_error, term_error)


def float64_forward_error(layers: int, inner: int, amplification: float = 1e3) -> float:
    """Relative bound (to the output's magnitude) for two evaluations of one network in float64 that differ
    only in operation order (batched and masked vs cached and incremental): each layer's GEMMs,
    attention sums and norms round within gamma_inner relative of their absolute values; through
    ``layers`` layers errors compound by at most ``amplification`` each way (the network's condition:
    RMS norms, softmax and residual sums of these tiny models amplify relative errors by far less than
    1e3; the test's subject, a wrong mask or position, moves logits by 1e-3 relative or more, twelve
    orders of magnitude above the resulting ~1e-10)."""
    return 2 * layers * amplification * gamma(inner, torch.float64)


def float32_forward_error(layers: int, inner: int, amplification: float = 10.0) -> float:
    """Relative bound (to the output's magnitude) for two float32 evaluations of one network that differ
    only in kernels and operation order (vLLM's CPU kernels and transformers'): each layer's GEMMs,
    attention sums and norms round within gamma_inner relative of their absolute values, twice over (both
    sides), compounding through ``layers`` layers by at most ``amplification`` each (these tiny models'
    RMS norms, softmax and residual sums; ``float64_forward_error`` allows 1e3 where its subject, a mask,
    is twelve orders above it). A wrong layer (the off-by-one trap), position or norm moves features by
    1e-1 relative or more; the tests show that gap against this bound."""
    return 2 * layers * amplification * gamma(inner, torch.float32)
