"""DSpark's loss terms in the fused loss against the plain reference (float64): the Markov bias folded
into the chunked head GEMM (gradients of the features and of W2), acceptance, Renyi-1/2, D-PARD; and the
terms every variant may use beside them: D-PACE's block credit and total variation (TV)."""

from typing import NamedTuple

import pytest
import tolerances
import torch
from kernel_builds import COMPILED, NATIVE_BUILDS

from dflash_trainer.loss import (
    BlockCredit,
    LossTerms,
    PairTerm,
    fused,
    fused_draft_loss,
    native,
    reference_draft_loss,
)
from dflash_trainer.loss.chunks import chunk_bounds
from dflash_trainer.loss.logits import transform_logits

F64 = torch.float64


def make_inputs(n=40, h=16, v=60, r=6, block=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g, dtype=F64).requires_grad_()
    ht = hs.detach() + 0.7 * torch.randn(n, h, generator=g, dtype=F64)
    w_head = torch.randn(v, h, generator=g, dtype=F64) * 0.6
    labels = torch.randint(0, v, (n,), generator=g)
    take = torch.rand(n, generator=g) < 0.5
    labels[take] = (hs.detach() @ w_head.T).argmax(-1)[take]
    weights = torch.rand(n, generator=g, dtype=F64) + 0.1
    weights[::block] = 0.0  # slot 0 of every block
    weights[7] = 0.0  # a masked slot inside a block
    e = (torch.randn(n, r, generator=g, dtype=F64) * 0.5).requires_grad_()
    w2 = (torch.randn(v, r, generator=g, dtype=F64) * 0.5).requires_grad_()
    slots = torch.arange(n) % block
    blocks = torch.arange(n) // block
    return hs, ht, w_head, labels, weights, e, w2, slots, blocks


def pairs(renyi=0.0, tv=0.0):
    """The pair terms of the per-row statistics: DSpark's acceptance (a metric) and Renyi-1/2 (weight
    ``renyi``), both reported whenever a per-row term is on, then TV ``1 - a`` (weight ``tv``) if asked."""
    out = (PairTerm("accept", "overlap"), PairTerm("renyi", "renyi_half", weight=renyi))
    return out + ((PairTerm("tv", "overlap", weight=tv, scale=-1.0, offset=1.0),) if tv else ())


def dpard(alpha=0.5):
    return BlockCredit("overlap", alpha)


def dpace(alpha=0.5):
    return BlockCredit("label_prob", alpha)


class Case(NamedTuple):
    """A loss call's terms, and whether it adds the Markov bias (the rows' features and W2)."""

    terms: LossTerms
    bias: bool = False


CASES = {
    "bias_ce": Case(LossTerms(), bias=True),
    "bias_kl_cap": Case(LossTerms(kl_weight=0.3, temperature=1.7, cap_weight=0.2), bias=True),
    "bias_softcap": Case(LossTerms(kl_weight=0.2, cap_weight=0.3, softcap=2.5, logit_scale=0.8), bias=True),
    "acceptance": Case(LossTerms(kl_weight=0.5, pair_terms=pairs())),
    "renyi": Case(LossTerms(pair_terms=pairs(renyi=0.7))),
    "renyi_bias_cap": Case(LossTerms(kl_weight=0.2, cap_weight=0.1, pair_terms=pairs(renyi=0.4)), bias=True),
    "dpard": Case(LossTerms(kl_weight=1.0, pair_terms=pairs(), credit=dpard(0.5))),
    "dspark_all": Case(
        LossTerms(kl_weight=0.4, cap_weight=0.1, pair_terms=pairs(renyi=0.5), credit=dpard(0.3)), bias=True
    ),
    "teacher_labels": Case(LossTerms(label_source="teacher", pair_terms=pairs(renyi=0.3)), bias=True),
    # KL at T != 1 (the kernel keeps the teacher at T = 1 apart), Tc != 1, a softcap, D-PARD with the bias
    "renyi_tempered_softcap": Case(
        LossTerms(
            kl_weight=0.3,
            temperature=1.7,
            cap_weight=0.2,
            cap_temperature=0.8,
            softcap=2.5,
            logit_scale=0.8,
            pair_terms=pairs(renyi=0.6),
            credit=dpard(),
        ),
        bias=True,
    ),
    # D-PACE (no teacher needed) and TV, alone and with the other terms
    "dpace": Case(LossTerms(credit=dpace(0.5))),
    "dpace_kl_cap_softcap": Case(LossTerms(kl_weight=0.4, cap_weight=0.2, softcap=2.5, credit=dpace(0.3))),
    "dpace_teacher_labels": Case(LossTerms(label_source="teacher", pair_terms=pairs(), credit=dpace())),
    "tv": Case(LossTerms(pair_terms=pairs(tv=0.8))),
    "tv_kl_tempered_cap": Case(
        LossTerms(kl_weight=0.3, temperature=1.7, cap_weight=0.2, cap_temperature=0.8, pair_terms=pairs(tv=0.5))
    ),
    "tv_renyi_bias_dpard": Case(
        LossTerms(kl_weight=0.2, pair_terms=pairs(renyi=0.4, tv=0.6), credit=dpard()), bias=True
    ),
    "dpace_tv_bias": Case(LossTerms(softcap=2.5, logit_scale=0.8, pair_terms=pairs(tv=0.7), credit=dpace()), bias=True),
}


def float64_bounds(case, inputs):
    """``tolerances.fused_loss_float64_apart`` of ``case``'s loss on ``inputs`` (bias and credit
    included), the gradient bounds always a tuple: (h[, the bias rows, W2])."""
    hs, ht, w_head, labels, weights, e, w2, _, blocks = inputs
    kw = dict(bias_rows=e, bias_weight=w2) if case.bias else {}
    loss_apart, grad_apart, term_apart = tolerances.fused_loss_float64_apart(
        hs, ht, w_head, labels, weights, case.terms, block_ids=blocks, **kw
    )
    return loss_apart, grad_apart if isinstance(grad_apart, tuple) else (grad_apart,), term_apart


def _call(fn, case, hs, ht, w_head, labels, weights, e, w2, slots, blocks, **extra):
    kw = {}
    if case.bias:
        kw.update(bias_rows=e, bias_weight=w2)
    if case.terms.credit is not None:
        kw.update(block_ids=blocks)
    return fn(hs, ht, w_head, labels, weights, case.terms, **kw, **extra)


@COMPILED
@pytest.mark.parametrize("name", list(CASES))
def test_dspark_terms_match_reference_float64(name, compiled):
    case = CASES[name]
    inputs = make_inputs()
    hs, e, w2, weights = inputs[0], inputs[5], inputs[6], inputs[4]
    loss, metrics = _call(
        fused_draft_loss, case, *inputs, chunk_size=12, compile=compiled, slot_ids=inputs[7], num_slots=5
    )
    ref_loss, ref_metrics = _call(reference_draft_loss, case, *inputs)
    wrt = [hs] + ([e, w2] if case.bias else [])
    grads = torch.autograd.grad(loss, wrt)
    ref_grads = torch.autograd.grad(ref_loss, wrt)
    # float64 against float64: each within tolerances.fused_loss_error at float64 of the exact value, so
    # within twice it; a per-row term x (CE, KL, the entropy, the pair statistics) within 4 delta (1 + |x|),
    # which the term bound (at least 4 delta) times 1 + |x| covers
    loss_bound, grad_bounds, term_bound = float64_bounds(case, inputs)
    assert abs(loss.item() - ref_loss.item()) <= loss_bound
    for g, rg, bound in zip(grads, ref_grads, grad_bounds):
        assert ((g - rg).abs() <= bound).all()
    assert grads[0][weights == 0].abs().max().item() == 0.0
    for key in ("ce", "kl", "cap", "accuracy"):
        assert abs(metrics[key].item() - ref_metrics[key].item()) <= term_bound, key

    def pair_bound(x):  # a per-row pair statistic x >= 0 (acceptance, Renyi, TV), or the mean of one
        return term_bound * (1 + x.abs()) + 2 * tolerances.gamma(len(weights), F64) * x.abs()

    if "accept" in ref_metrics:
        rows = ref_metrics["overlap_rows"]
        assert ((metrics["overlap_rows"] - rows).abs() <= pair_bound(rows)).all()
        assert abs(metrics["renyi"] - ref_metrics["renyi"]) <= pair_bound(ref_metrics["renyi"])
        assert metrics["per_slot"]["accept"].shape == (5,)
        assert 0.0 < metrics["accept"].item() < 1.0
    if "tv" in ref_metrics:
        assert abs(metrics["tv"] - ref_metrics["tv"]) <= pair_bound(ref_metrics["tv"])


def test_bias_changes_the_loss():
    """The bias really reaches the logits: the loss with it differs, and W2 gets a nonzero gradient."""
    hs, ht, w_head, labels, weights, e, w2, *_ = make_inputs()
    plain, _ = fused_draft_loss(hs, ht, w_head, labels, weights)
    biased, _ = fused_draft_loss(hs, ht, w_head, labels, weights, bias_rows=e, bias_weight=w2)
    assert abs(plain.item() - biased.item()) > 1e-3
    (g,) = torch.autograd.grad(biased, [w2])
    assert g.abs().max().item() > 1e-4


@pytest.mark.parametrize("chunk", [1, 5, 7, 13, None])
def test_dpard_does_not_depend_on_chunking(chunk):
    case = CASES["dspark_all"]
    inputs = make_inputs()
    base, _ = _call(fused_draft_loss, case, *inputs, chunk_size=1000)
    loss, _ = _call(fused_draft_loss, case, *inputs, chunk_size=chunk)
    assert abs(loss.item() - base.item()) <= float64_bounds(case, inputs)[0]


def test_chunk_bounds_keep_blocks_whole():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3, 4])
    bounds = chunk_bounds(13, 4, ids)
    assert [(b.start, b.stop) for b in bounds] == [(0, 3), (3, 6), (6, 12), (12, 13)]
    assert chunk_bounds(5, 2, None) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_bad_dspark_arguments():
    hs, ht, w_head, labels, weights, e, w2, _, blocks = make_inputs()
    with pytest.raises(ValueError, match="teacher_hidden"):
        fused_draft_loss(hs, None, w_head, labels, weights, LossTerms(pair_terms=pairs(renyi=1.0)))
    with pytest.raises(ValueError, match="block_ids"):
        fused_draft_loss(hs, ht, w_head, labels, weights, LossTerms(credit=dpard()))
    with pytest.raises(ValueError, match="bias_weight"):
        fused_draft_loss(hs, ht, w_head, labels, weights, bias_rows=e, bias_weight=w2[:5])


@COMPILED
def test_markov_bias_never_allocates_positions_by_vocab(compiled):
    from test_loss import OpRecorder

    n, h, v, r = 4096, 64, 32000, 32
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ht = torch.randn(n, h, generator=g)
    w_head = torch.randn(v, h, generator=g) * 0.1
    e = (torch.randn(n, r, generator=g) * 0.1).requires_grad_()
    w2 = (torch.randn(v, r, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    weights = torch.ones(n)
    terms = LossTerms(kl_weight=0.5, cap_weight=0.1, pair_terms=pairs(renyi=0.5), credit=dpard())
    with OpRecorder() as rec:
        loss, _ = fused_draft_loss(
            hs,
            ht,
            w_head,
            labels,
            weights,
            terms,
            chunk_size=256,
            compile=compiled,
            bias_rows=e,
            bias_weight=w2,
            block_ids=torch.arange(n) // 16,
        )
        loss.backward()
    assert rec.count("addmm") + rec.count("addmm_") >= n // 256  # the bias GEMM ran chunk by chunk
    assert rec.largest < n * v, f"a tensor with {rec.largest} elements (N x V = {n * v}) was allocated"
    assert rec.largest <= 256 * v
    assert torch.isfinite(w2.grad).all() and w2.grad.abs().max() > 0
    # the eager passes' acceptance (torch.minimum over [c, V]) ran only where asked: the kernel has its own
    assert (rec.count("minimum") > 0) == (compiled is False)


def test_per_row_terms_run_in_the_native_kernel_on_the_cpu(monkeypatch):
    """compile="auto" on the CPU keeps the native kernel with DSpark's terms on (every kernel computes
    them in its row pass), and the planner sees the same."""
    monkeypatch.delenv(fused.COMPILE_ENV, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float32, F64):
        assert fused.epilogue_kind("auto", cpu, dtype) == "native" == fused.planned_epilogue("auto", "cpu", dtype)
    assert fused.planned_epilogue("auto", "cuda", torch.bfloat16) == "triton"
    assert fused.epilogue_kind(False, cuda, torch.bfloat16) == "eager"


def raw_rows(rows=9, v=3000, seed=0, dtype=F64):
    """Raw logits of a chunk (three kernel blocks, the last ragged), teacher near the student."""
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(rows, v, generator=g, dtype=F64) * 3
    zt = zs + torch.randn(rows, v, generator=g, dtype=F64) * 1.5
    labels = torch.randint(0, v, (rows,), generator=g)
    coef = torch.rand(rows, generator=g, dtype=F64) / rows
    return zs.to(dtype), zt.to(dtype), labels, coef


def kernel_terms(a, temp, tc, scale, cap, beta=None, teacher_labels=False):
    """The terms of a kernel call: KL weight, T, Tc, logit scale, softcap; with ``beta`` (the Renyi
    weight) the pair statistics on (``pairs``)."""
    return LossTerms(
        kl_weight=a,
        temperature=temp,
        cap_temperature=tc,
        logit_scale=scale,
        softcap=cap,
        label_source="teacher" if teacher_labels else "data",
        pair_terms=pairs(renyi=beta) if beta is not None else (),
    )


KERNEL_CASES = {  # (kl_weight, T, Tc, scale, softcap, renyi_weight, teacher labels)
    "no_kl": (0.0, 1.0, 1.0, 1.0, None, 0.7, False),
    "kl_T1": (0.4, 1.0, 1.0, 1.0, None, 0.5, False),  # the teacher's e^u serves both KL and the per-row terms
    "kl_tempered_softcap": (0.3, 1.7, 0.8, 0.9, 4.0, 0.6, False),
    "acceptance_only_teacher_labels": (0.2, 1.0, 1.3, 1.0, None, 0.0, True),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
@NATIVE_BUILDS
def test_native_kernel_per_row_terms_float64(name, build):
    """The kernel alone on raw logits: acceptance, Renyi and G against autograd of the row loss
    sum_r coef_r [(1-a) CE + a T^2 KL + beta Renyi] w.r.t. the raw logits (float64); the DFlash row
    terms and G are unchanged by the flag where beta = 0."""
    a, temp, tc, scale, cap, beta, teacher_labels = KERNEL_CASES[name]
    zs, zt, labels, coef = raw_rows()
    y = None if teacher_labels else labels
    g = torch.empty_like(zs)
    terms = kernel_terms(a, temp, tc, scale, cap, beta, teacher_labels)
    out = native.chunk_epilogue(zs, zt, y, coef, g, terms)
    lse, z_y, s_arg, t_arg, entropy, kl, accept, renyi = out

    raw = zs.clone().requires_grad_()
    z, w = transform_logits(raw, scale, cap), transform_logits(zt, scale, cap)
    p, q = torch.softmax(z, -1), torch.softmax(w, -1)
    target = w.argmax(-1) if teacher_labels else labels
    ce = torch.nn.functional.cross_entropy(z, target, reduction="none")
    log_qT, log_pT = torch.log_softmax(w / temp, -1), torch.log_softmax(z / temp, -1)
    kl_ref = (log_qT.exp() * (log_qT - log_pT)).sum(-1)
    renyi_ref = -2 * (p * q).sqrt().sum(-1).log()
    row_loss = (1 - a) * ce + a * temp**2 * kl_ref + beta * renyi_ref
    (grad,) = torch.autograd.grad((coef * row_loss).sum(), raw)
    # the kernel in double and autograd's reference, each within tolerances.epilogue_error at float64 of
    # the exact epilogue: within twice it
    row_error, g_error = tolerances.epilogue_error(zs, zt, coef, terms, F64)
    for got, want in ((accept, torch.minimum(p, q).sum(-1)), (renyi, renyi_ref), (lse, torch.logsumexp(z, -1))):
        assert ((got - want.detach()).abs() <= 2 * row_error(want.detach())).all()
    if a > 0:
        assert ((kl - kl_ref.detach()).abs() <= 2 * row_error(kl_ref.detach())).all()
    else:
        assert (kl == 0).all()
    assert torch.equal(t_arg, w.argmax(-1)) and torch.equal(s_arg, z.argmax(-1))
    assert ((g - grad).abs() <= 2 * g_error).all(), ((g - grad).abs() / g_error).max().item()
    assert 0.05 < accept.min().item() and accept.max().item() < 1.0  # the test data is informative
    plain_terms = kernel_terms(a, temp, tc, scale, cap, teacher_labels=teacher_labels)
    without = native.chunk_epilogue(zs, zt, y, coef, g_plain := torch.empty_like(zs), plain_terms)
    for x, x0 in zip(out[:6], without):
        assert torch.equal(x, x0)
    if beta == 0:
        assert torch.equal(g, g_plain)
    rows_only = native.chunk_epilogue(zs, zt, y, coef, None, terms)
    for x, x0 in zip(rows_only, out):  # no gradient: the same row terms
        assert x0 is None if x is None else torch.equal(x, x0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@NATIVE_BUILDS
def test_native_kernel_per_row_rows_do_not_depend_on_threads(dtype, build):
    zs, zt, labels, coef = raw_rows(rows=37, dtype=dtype)
    coef = coef.float()
    threads, results = torch.get_num_threads(), []
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            for cap in (None, 4.0):
                g = torch.empty_like(zs)
                out = native.chunk_epilogue(zs, zt, labels, coef, g, kernel_terms(0.3, 1.7, 0.8, 0.9, cap, 0.5))
                results.append([*out, g])
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(results[:2], results[2:]):
        for x, y in zip(one, three):
            assert torch.equal(x, y)


@NATIVE_BUILDS
def test_native_per_row_terms_in_float32_and_bf16(build):
    """Every DSpark term at once through compile="auto" (the native kernel): fp32 against the float64
    reference to fp32 accuracy; a bf16 head (G and the bias in bf16) within bf16's rounding of it."""
    case = CASES["dspark_all"]
    inputs = make_inputs(n=60, h=32, v=3000, r=8, seed=1)
    ref_loss, ref_m = _call(reference_draft_loss, case, *inputs)
    ref_grads = torch.autograd.grad(ref_loss, [inputs[0], inputs[5], inputs[6]])
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (inputs[0], inputs[5], inputs[6])]
        hs, e, w2 = leaves
        ht, w_head, labels, weights, slots, blocks = inputs[1].to(dtype), inputs[2].to(dtype), *inputs[3:5], *inputs[7:]
        loss, m = _call(fused_draft_loss, case, hs, ht, w_head, labels, weights.to(dtype), e, w2, slots, blocks)
        grads = torch.autograd.grad(loss, leaves)
        assert_within_dspark_bounds(case, inputs, dtype, loss, m, grads, ref_loss, ref_m, ref_grads)


def assert_within_dspark_bounds(case, inputs, dtype, loss, m, grads, ref_loss, ref_m, ref_grads):
    """Loss, acceptance per row and the gradients of h, the bias rows and W2 within
    ``tolerances.fused_loss_error`` (bias and D-PARD included) of the float64 reference."""
    hs64, ht64, w64, labels, weights, e64, w2_64, _, blocks = inputs
    kw = dict(bias_rows=e64, bias_weight=w2_64) if case.bias else {}
    loss_error, grad_errors, term_error = tolerances.fused_loss_error(
        hs64, ht64, w64, labels, weights, dtype, case.terms, block_ids=blocks, **kw
    )
    assert abs(loss.item() - ref_loss.item()) <= loss_error, (dtype, abs(loss.item() - ref_loss.item()), loss_error)
    live = weights > 0
    accept_err = (m["overlap_rows"].double() - ref_m["overlap_rows"]).abs()[live]
    assert (accept_err <= term_error).all(), dtype
    grad_errors = grad_errors if isinstance(grad_errors, tuple) else (grad_errors,)
    for got, want, bound in zip(grads, ref_grads, grad_errors):
        bound = bound + tolerances.unit_roundoff(dtype) * want.abs() * (dtype != torch.float32)  # the own rounding
        assert ((got.double() - want).abs() <= bound).all(), (dtype, ((got.double() - want).abs() / bound).max().item())
    return term_error


@pytest.mark.parametrize("name", ["dpace_tv_bias", "tv_renyi_bias_dpard"])
def test_dpace_and_tv_in_float32_and_bf16(name):
    """D-PACE's credit (here with the bias, so every gradient is checked) and TV through compile="auto"
    (TV's gradient runs in the eager passes): fp32 and a bf16 head against the float64 reference within
    ``tolerances.fused_loss_error``, which derives both terms' bounds."""
    case = CASES[name]
    inputs = make_inputs(n=60, h=32, v=3000, r=8, seed=2)
    ref_loss, ref_m = _call(reference_draft_loss, case, *inputs)
    ref_grads = torch.autograd.grad(ref_loss, [inputs[0], inputs[5], inputs[6]])
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (inputs[0], inputs[5], inputs[6])]
        hs, e, w2 = leaves
        ht, w_head, labels, weights, slots, blocks = inputs[1].to(dtype), inputs[2].to(dtype), *inputs[3:5], *inputs[7:]
        loss, m = _call(fused_draft_loss, case, hs, ht, w_head, labels, weights.to(dtype), e, w2, slots, blocks)
        grads = torch.autograd.grad(loss, leaves)
        term_error = assert_within_dspark_bounds(case, inputs, dtype, loss, m, grads, ref_loss, ref_m, ref_grads)
        assert abs(m["tv"].item() - ref_m["tv"].item()) <= term_error, dtype


def test_dpace_credit_moves_weight_to_the_slots_that_gate_acceptance():
    """D-PACE's coefficient of a row is the credit W_t = sum_{k>=t} prod_{i<=k} s_i / n of its block,
    s_i = alpha + (1 - alpha) p_i(y_i): a confident first slot passes credit on to the later ones, a
    hopeless one cuts theirs. With an identity head (logit scale 3) each row's gradient is coef (p - e_y)
    times 3, so the coefficients are read off the gradient and checked against the formula by hand."""
    b, v, scale, alpha = 4, 8, 3.0, 0.5
    w_head = torch.eye(v, dtype=F64) * scale
    labels = torch.tensor([0, 1, 2, 3] * 2)
    hs = torch.nn.functional.one_hot(labels, v).to(F64)  # p(y) = e^3 / (e^3 + 7) on every row
    hs[5] = torch.nn.functional.one_hot(torch.tensor(7), v).to(F64)  # block 1, slot 1: p(y) = 1 / (e^3 + 7)
    hs.requires_grad_()
    weights = torch.tensor([0.0, 1, 1, 1] * 2, dtype=F64)
    blocks = torch.arange(8) // b
    loss, _ = fused_draft_loss(hs, None, w_head, labels, weights, LossTerms(credit=dpace(alpha)), block_ids=blocks)
    (g,) = torch.autograd.grad(loss, [hs])
    p_y = torch.softmax(hs.detach() @ w_head.T, -1).gather(1, labels[:, None]).squeeze(1)
    coef = g.gather(1, labels[:, None]).squeeze(1) / (scale * (p_y - 1))
    s_conf = alpha + (1 - alpha) * p_y
    hi, lo = s_conf[1].item(), s_conf[5].item()
    n = 6  # rows with loss
    w1 = [hi + hi**2 + hi**3, hi**2 + hi**3, hi**3]
    w2 = [lo + lo * hi + lo * hi**2, lo * hi + lo * hi**2, lo * hi**2]
    # the logits are exact here (one-hot rows, a scaled identity head); each probability is within the
    # softmax's relative error delta (its exponent, the scaling, a few units), so D-PACE's coefficients
    # are within b delta / alpha + gamma_2b relatively (tolerances.fused_loss_error's derivation), and
    # reading them off (p - 1, the division) and the formula by hand add gamma_6 more
    delta = tolerances.softmax_error(v, 2 * scale, F64) + 8 * tolerances.unit_roundoff(F64)
    rel = b * delta / alpha + tolerances.gamma(2 * b + 6, F64)
    assert torch.allclose(coef[1:4] * n, torch.tensor(w1, dtype=F64), rtol=rel, atol=0)
    assert torch.allclose(coef[5:8] * n, torch.tensor(w2, dtype=F64), rtol=rel, atol=0)
    assert coef[0] == 0 and coef[4] == 0
    assert (coef[5:8] < coef[1:4]).all()  # the hopeless first slot cuts every later slot's credit
