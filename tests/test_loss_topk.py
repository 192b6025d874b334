"""DFlash2's candidates out of the fused loss (``top_k``) against the plain reference in float64, on each
chunk epilogue (eager, native; Triton under ``TRITON_INTERPRET=1`` where triton is installed), and
``candidate_logits`` (the head's logits at given ids, gradient to the hidden states) against its
plain gather-and-contract reference."""

import importlib.util
import os
from dataclasses import replace

import pytest
import tolerances
import torch
from kernel_builds import COMPILED, NATIVE_BUILDS

if not torch.cuda.is_available():  # must precede the Triton kernel module's import (triton.jit reads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_loss import OpRecorder  # noqa: E402
from test_loss_dspark import Case, make_inputs, pairs  # noqa: E402

from dflash_trainer.loss import LossTerms, fused, fused_draft_loss, native, reference_draft_loss  # noqa: E402
from dflash_trainer.loss.candidates import candidate_logits, reference_candidate_logits  # noqa: E402

F64 = torch.float64
K = 16

CASES = {
    "ce": Case(LossTerms()),
    "kl_cap": Case(LossTerms(kl_weight=0.3, temperature=1.7, cap_weight=0.2, cap_temperature=0.8)),
    "softcap_scale": Case(LossTerms(kl_weight=0.2, cap_weight=0.3, softcap=2.5, logit_scale=0.8)),
    "dspark_bias": Case(LossTerms(kl_weight=0.2, pair_terms=pairs(renyi=0.4)), bias=True),
    "teacher_labels": Case(LossTerms(label_source="teacher", kl_weight=0.5, cap_weight=0.1)),
    # a decreasing transform: the smallest raw logits
    "negative_scale": Case(LossTerms(logit_scale=-0.7, kl_weight=0.2)),
}


def _call(fn, case, inputs, top_k=0, **extra):
    """``fn`` on ``inputs`` with the case's terms, their ``top_k`` set to ``top_k``."""
    hs, ht, w_head, labels, weights, e, w2, *_ = inputs
    kw = dict(bias_rows=e, bias_weight=w2) if case.bias else {}
    return fn(hs, ht, w_head, labels, weights, replace(case.terms, top_k=top_k), **kw, **extra)


def _assert_matches_reference(m, ref_m, weights, tol):
    ids, logits = m["topk_ids"], m["topk_logits"]
    assert ids.dtype == torch.int64 and ids.shape == ref_m["topk_ids"].shape
    assert torch.equal(ids, ref_m["topk_ids"])
    keep = weights > 0
    assert (logits[keep] - ref_m["topk_logits"][keep].to(logits.dtype)).abs().max().item() < tol
    assert (ids[~keep] == -1).all() and (logits[~keep] == -torch.inf).all()  # weight-0 rows
    assert (logits[keep].diff(dim=1) <= 0).all()  # sorted descending


@COMPILED
@pytest.mark.parametrize("name", list(CASES))
def test_topk_matches_reference_and_leaves_the_loss_alone(name, compiled):
    """ids exactly, logits within 1e-12; loss and gradients bit-identical to top_k=0."""
    case, inputs = CASES[name], make_inputs()
    hs, e, w2, weights = inputs[0], inputs[5], inputs[6], inputs[4]
    wrt = [hs] + ([e, w2] if case.bias else [])
    loss, m = _call(fused_draft_loss, case, inputs, chunk_size=12, compile=compiled, top_k=K)
    grads = torch.autograd.grad(loss, wrt)
    loss0, m0 = _call(fused_draft_loss, case, inputs, chunk_size=12, compile=compiled)
    grads0 = torch.autograd.grad(loss0, wrt)
    _, ref_m = _call(reference_draft_loss, case, inputs, top_k=K)
    assert m["topk_logits"].dtype == F64
    _assert_matches_reference(m, ref_m, weights, 1e-12)
    assert loss.item() == loss0.item()
    assert all(torch.equal(g, g0) for g, g0 in zip(grads, grads0))
    assert "topk_ids" not in m0 and all(torch.equal(m[key], m0[key]) for key in m0 if key != "per_slot")


@pytest.mark.parametrize("chunk", [1, 7, None])
@COMPILED
def test_topk_does_not_depend_on_chunking(chunk, compiled):
    case, inputs = CASES["softcap_scale"], make_inputs(seed=3)
    _, m = _call(fused_draft_loss, case, inputs, chunk_size=chunk, compile=compiled, top_k=K)
    _, ref_m = _call(reference_draft_loss, case, inputs, top_k=K)
    _assert_matches_reference(m, ref_m, inputs[4], 1e-12)


@COMPILED
def test_top_1_is_the_argmax_and_top_v_the_full_sort(compiled):
    inputs = make_inputs()
    hs, ht, w_head, labels, weights = inputs[:5]
    v, keep = w_head.shape[0], weights > 0
    z = (hs.detach() @ w_head.T)[keep]
    _, m1 = fused_draft_loss(hs, ht, w_head, labels, weights, LossTerms(top_k=1), compile=compiled, chunk_size=9)
    assert m1["topk_ids"].shape == (hs.shape[0], 1)
    assert torch.equal(m1["topk_ids"][keep, 0], z.argmax(-1))
    _, mv = fused_draft_loss(hs, ht, w_head, labels, weights, LossTerms(top_k=v), compile=compiled, chunk_size=9)
    values, order = z.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(mv["topk_ids"][keep], order)
    apart = logits_apart(hs[keep], w_head).gather(1, order)
    assert ((mv["topk_logits"][keep] - values).abs() <= apart).all()


def test_bad_top_k():
    """A negative or non-int K is refused when the terms are built, one above the vocabulary by the call."""
    hs, ht, w_head, labels, weights = make_inputs()[:5]
    v = w_head.shape[0]
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"LossTerms: top_k must be an int >= 0"):
            LossTerms(top_k=bad)
    with pytest.raises(ValueError, match=r"fused_draft_loss: terms.top_k must be <= 60"):
        fused_draft_loss(hs, ht, w_head, labels, weights, LossTerms(top_k=v + 1))


def test_no_rows_with_weight():
    hs, ht, w_head, labels, weights = make_inputs()[:5]
    _, m = fused_draft_loss(hs, ht, w_head, labels, torch.zeros_like(weights), LossTerms(top_k=3))
    assert m["topk_ids"].shape == (hs.shape[0], 3) and (m["topk_ids"] == -1).all()
    assert (m["topk_logits"] == -torch.inf).all()


def raw_rows(v=40_000, rows=7, seed=0):
    """Raw logits [rows, v] over 40 kernel blocks of 1,024 (more blocks than K, and fewer: the kernel
    bounds the K-th logit by the K-th block maximum): ties at the top across blocks, a row rising to its
    last block, a row whose K best lie one per block, one whose K best share a block, equal values."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, v, generator=g, dtype=F64) * 3
    z[0, [17, 1500, v - 1]] = 20.0
    z[0, [3, 2048, 30_000]] = 19.0
    z[1] = torch.linspace(-5, 5, v, dtype=F64)
    z[2, torch.arange(K) * 2411] = 30.0 + torch.arange(K, dtype=F64)
    z[3] = 1.5
    z[4, 7 * 1024 + torch.arange(K) * 3] = 25.0 - torch.arange(K, dtype=F64) % 4  # ties inside one block
    z[5, ::1024] = 12.0  # every block's maximum equal
    return z


@pytest.mark.parametrize("k", [1, K, 40_000])
@NATIVE_BUILDS
def test_native_kernel_top_k_with_ties_float64(k, build):
    """The kernel alone: sorted descending, ties by lower id (a stable sort), rows on two threads."""
    z = raw_rows()
    coef = torch.full((z.shape[0],), 0.1, dtype=F64)
    labels = torch.zeros(z.shape[0], dtype=torch.int64)
    values, order = z.sort(dim=-1, descending=True, stable=True)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            out = native.chunk_epilogue(z, None, labels, coef, None, LossTerms(top_k=k))
            ids, logits = out[-2:]
            assert torch.equal(ids, order[:, :k]) and torch.equal(logits, values[:, :k])
    finally:
        torch.set_num_threads(threads)
    # with a softcap the selection reads the transformed row: the same order, the capped values
    out = native.chunk_epilogue(z, None, labels, coef, None, LossTerms(logit_scale=0.5, softcap=4.0, top_k=k))
    assert torch.equal(out[-2], order[:, :k])
    # the same exact raw values transformed on both sides: (3u + elementary) of a logit at most 4, each
    u = tolerances.unit_roundoff(F64)
    apart = 2 * (3 * u + tolerances.elementary_error(F64)) * 4.0
    assert (out[-1] - 4.0 * torch.tanh(values[:, :k] * 0.5 / 4.0)).abs().max().item() <= apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@NATIVE_BUILDS
def test_native_top_k_in_float32_and_bf16_matches_eager(dtype, build):
    """Same transformed values as the eager passes (the same GEMM output); ids point at those values."""
    hs, ht, w_head, labels, weights = (x.to(dtype) if x.is_floating_point() else x for x in make_inputs(v=3000)[:5])
    hs = hs.detach()
    terms = LossTerms(kl_weight=0.2, logit_scale=0.8, top_k=K)
    _, mn = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=16, compile="native")
    _, me = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=16, compile=False)
    keep = weights > 0
    assert mn["topk_logits"].dtype == torch.float32
    assert torch.equal(mn["topk_logits"], me["topk_logits"])
    z = (hs @ w_head.T).float() * 0.8
    assert torch.equal(z[keep].gather(1, mn["topk_ids"][keep]), mn["topk_logits"][keep])
    if dtype == torch.float32:
        assert torch.equal(mn["topk_ids"], me["topk_ids"])


@COMPILED
def test_topk_never_allocates_positions_by_vocab(compiled):
    """The no-[N x V] test of test_loss.py with top_k=16 (smaller, same pattern); the native kernel
    selects in its row pass (no aten topk), the eager passes call torch.topk once per chunk."""
    n, h, v, c = 1024, 32, 8192, 128
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ht = torch.randn(n, h, generator=g)
    w_head = torch.randn(v, h, generator=g) * 0.1
    labels = torch.randint(0, v, (n,), generator=g)
    with OpRecorder() as rec:
        loss, m = fused_draft_loss(
            hs,
            ht,
            w_head,
            labels,
            torch.ones(n),
            LossTerms(kl_weight=0.15, cap_weight=0.1, top_k=K),
            chunk_size=c,
            compile=compiled,
        )
        loss.backward()
    assert rec.count("mm") >= 3 * (n // c)
    assert rec.largest < n * v and rec.largest <= c * v
    assert rec.count("topk") == (0 if compiled == "native" else n // c)
    assert m["topk_ids"].shape == (n, K) and (m["topk_ids"] >= 0).all()


def test_op_fake_and_opcheck_with_top_k():
    """The custom op's fake implementation gives [N, K] outputs (meta tensors), and opcheck holds."""
    n, h, v = 13, 8, 40
    with torch.device("meta"):
        hs = torch.empty(n, h, requires_grad=True)
        loss, m = fused_draft_loss(
            hs, None, torch.empty(v, h), torch.zeros(n, dtype=torch.long), torch.ones(n), LossTerms(top_k=7)
        )
    assert m["topk_ids"].shape == (n, 7) and m["topk_ids"].dtype == torch.int64
    assert m["topk_logits"].shape == (n, 7) and m["topk_logits"].dtype == torch.float32
    from test_loss_ops import TERMS as OP_TERMS
    from test_loss_ops import op_args

    for policy in ("native", "false"):
        args = op_args(n=n, v=v, terms=replace(OP_TERMS, top_k=5), policy=policy)
        torch.library.opcheck(fused.fused_draft_loss_op, args)


def test_topk_under_the_triton_interpreter():
    """Triton kernel (fp32, interpreted on the CPU), then torch.topk over the raw-logit buffer."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'triton==3.7.1' numpy; make test does)")
    if not fused.triton_runs_on(torch.device("cpu" if not torch.cuda.is_available() else "cuda")):
        pytest.skip("the Triton kernel module was imported without TRITON_INTERPRET=1 (set it before the first import)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("kl_cap", "softcap_scale", "dspark_bias", "negative_scale"):
        case, inputs = CASES[name], make_inputs()
        _, ref_m = _call(reference_draft_loss, case, inputs, top_k=K)
        f32 = [x.detach().float().to(dev) if x.is_floating_point() else x.to(dev) for x in inputs]
        f32[0].requires_grad_()
        loss, m = _call(fused_draft_loss, case, f32, chunk_size=7, compile="triton", top_k=K)
        loss0, _ = _call(fused_draft_loss, case, f32, chunk_size=7, compile="triton")
        assert loss.item() == loss0.item()
        _assert_matches_reference({k: v.cpu() for k, v in m.items() if k.startswith("topk")}, ref_m, inputs[4], 1e-5)


def logits_apart(hs, head, logit_scale=1.0):
    """``[N, V]``: how far two float64 evaluations of the transformed logits ``transform(h_i . w_v)`` may
    lie apart: the dot product over H (gamma_H of ``sum |h_j w_j|``) times the scale (the softcap's
    derivative is at most 1), and the transform's own roundings (a product, a division, tanh, a
    product: (3u + elementary) of a logit at most ``|scale| sum |h_j w_j|``), on each side."""
    u = tolerances.unit_roundoff(F64)
    size = abs(logit_scale) * (hs.detach().abs() @ head.abs().T)
    return 2 * (tolerances.gamma(hs.shape[1], F64) + 3 * u + tolerances.elementary_error(F64)) * size


def candidate_grad_apart(hs, head, ids, upstream, logit_scale=1.0, softcap=None):
    """``[N, H]``: the same for the gradient ``sum_k up_k s t'(s h . w_k) w_k`` of the candidate logits:
    each term within ``|up_k s w_k|`` times the derivative's error (none without a softcap but the
    products' 2u; with one, 1 - tanh^2 to 2 elementary + 6u, and the argument's error through it, at most
    twice the argument's), summed over K (gamma_K), on each side."""
    u = tolerances.unit_roundoff(F64)
    w = head[ids.clamp(min=0)] * (ids >= 0)[..., None]  # [N, K, H]
    terms = upstream.abs()[..., None] * abs(logit_scale) * w.abs()
    if softcap is None:
        rel = torch.full(ids.shape, 2 * u, dtype=F64)
    else:
        raw = (w.abs() * hs.detach().abs()[:, None, :]).sum(-1)  # sum |h_j w_j| per candidate
        arg_error = (tolerances.gamma(hs.shape[1], F64) + 2 * u) * abs(logit_scale) * raw / softcap
        rel = 2 * tolerances.elementary_error(F64) + 6 * u + 2 * arg_error
    per_side = (rel[..., None] * terms).sum(1) * (1 + tolerances.gamma(ids.shape[1], F64))
    return 2 * per_side


def candidate_inputs(n=10, h=6, v=30, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g, dtype=F64).requires_grad_()
    head = torch.randn(v, h, generator=g, dtype=F64) * 0.7
    ids = torch.randint(0, v, (n, k), generator=g)
    ids[3] = -1  # a weight-0 row of the fused loss
    return hs, head, ids


@pytest.mark.parametrize("transform", [{}, dict(logit_scale=0.8, softcap=2.5)], ids=["plain", "softcap_scale"])
def test_candidate_logits_match_the_reference_float64(transform):
    hs, head, ids = candidate_inputs()
    out = candidate_logits(hs, head, ids, chunk_size=3, **transform)  # ragged last chunk
    ref = reference_candidate_logits(hs, head, ids, **transform)
    assert out.dtype == F64 and out.shape == ids.shape
    assert torch.equal(out[3], torch.full((4,), -torch.inf, dtype=F64))
    valid = ids >= 0
    scale = transform.get("logit_scale", 1.0)
    apart = logits_apart(hs, head, scale).gather(1, ids.clamp(min=0))
    assert ((out - ref).abs() <= apart)[valid].all()
    upstream = torch.randn(ids.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(out, hs, upstream)
    (ref_grad,) = torch.autograd.grad(ref, hs, upstream.masked_fill(~valid, 0.0))
    apart = candidate_grad_apart(hs, head, ids, upstream, scale, transform.get("softcap"))
    assert ((grad - ref_grad).abs() <= apart).all()
    assert grad[3].abs().max().item() == 0.0


def test_candidate_logits_gradcheck():
    hs, head, ids = candidate_inputs(n=5, h=3, v=8, k=3)
    ids[3] = 2  # gradcheck perturbs every input entry: no -inf outputs here

    def fn(x):
        return candidate_logits(x, head, ids, logit_scale=1.3, softcap=3.0, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (hs,))


def test_candidate_logits_never_keep_the_gathered_rows():
    """What autograd keeps for the backward: the inputs and [N, K] tensors, never [N, K, H] (nor a chunk of it)."""
    n, h, v, k = 64, 32, 500, 16
    hs, head, ids = candidate_inputs(n, h, v, k)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = candidate_logits(hs, head, ids, softcap=3.0, chunk_size=8)
    out[ids >= 0].sum().backward()
    assert saved and max(saved) <= max(n * h, v * h, n * k)
    assert all(s not in (n * k * h, 8 * k * h) for s in saved)


def test_candidate_logits_equal_the_fused_top_k():
    """candidate_logits at the fused loss's ids gives back its topk_logits (no Markov bias here)."""
    hs, ht, w_head, labels, weights = make_inputs()[:5]
    terms = LossTerms(softcap=2.5, logit_scale=0.8, top_k=K)
    _, m = fused_draft_loss(hs, ht, w_head, labels, weights, terms, compile="native")
    z = candidate_logits(hs, w_head, m["topk_ids"], logit_scale=0.8, softcap=2.5)
    keep = weights > 0
    apart = logits_apart(hs, w_head, 0.8).gather(1, m["topk_ids"].clamp(min=0))
    assert ((z - m["topk_logits"]).abs() <= apart)[keep].all()
    assert (z[~keep] == -torch.inf).all()
