"""The Triton chunk epilogue on the CPU under ``TRITON_INTERPRET=1``: fp32 against the float64 reference
and against the native kernel, over the term sets of test_loss.py (CE, KL at T != 1, CAP, softcap,
zero-weight rows, a ragged last chunk, vocabularies of several kernel blocks).

Where triton is not installed (``make test`` installs it) or its kernel module was imported without the
interpreter on a machine without CUDA, these tests are skipped and say why. The interpreter's run time
is not a performance figure: it executes the kernel's blocks as numpy arrays."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the kernel module's import (triton.jit reads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install 'triton==3.7.1' numpy; make test does)")

import tolerances  # noqa: E402
from kernel_builds import NATIVE_BUILDS  # noqa: E402
from test_loss import TERMS, assert_within_derived_bounds, make_inputs  # noqa: E402
from test_loss_dspark import Case, dpace, dpard, kernel_terms, pairs  # noqa: E402

from dflash_trainer.loss import LossTerms, fused, fused_draft_loss, native, reference_draft_loss  # noqa: E402

kernel = fused.triton_epilogue()
if not fused.triton_runs_on(torch.device("cpu")):
    pytest.skip(
        "the Triton kernel module was imported without TRITON_INTERPRET=1 (set it before the first import)",
        allow_module_level=True,
    )

V = 2500  # three kernel blocks of 1024 logits, the last ragged


@pytest.mark.parametrize("name", list(TERMS))
def test_triton_float32_matches_the_float64_reference(name):
    """41 rows in chunks of 7 (the last has 6), every sixth row weight 0: loss, gradient and metrics."""
    terms = TERMS[name]
    hs64, ht64, w64, labels, weights, _ = make_inputs(n=41, h=16, v=V)
    ref, ref_m = reference_draft_loss(hs64, ht64, w64, labels, weights, terms)
    (ref_grad,) = torch.autograd.grad(ref, hs64)
    hs = hs64.detach().float().requires_grad_()
    loss, m = fused_draft_loss(
        hs, ht64.float(), w64.float(), labels, weights.float(), terms, chunk_size=7, compile="triton"
    )
    loss.backward()
    assert_within_derived_bounds(
        loss, hs.grad, ref, ref_grad, hs64, ht64, w64, labels, weights, torch.float32, terms, name
    )
    assert hs.grad[weights == 0].abs().max().item() == 0.0
    *_, term_error = tolerances.fused_loss_error(hs64, ht64, w64, labels, weights, torch.float32, terms)
    for key in ("ce", "kl", "cap"):
        assert abs(m[key].item() - ref_m[key].item()) <= term_error, (name, key)
    for key in ("accuracy", "agreement"):  # counts of argmax matches: the same rows match (no near ties)
        assert m[key].item() == ref_m[key].item(), (name, key)
    with torch.no_grad():  # inference: the kernel without its gradient pass
        loss_ng, _ = fused_draft_loss(
            hs, ht64.float(), w64.float(), labels, weights.float(), terms, chunk_size=7, compile="triton"
        )
    assert loss_ng.item() == loss.item()


def raw_chunk(dtype, rows=9, seed=0):
    """Raw logits of a chunk as the GEMMs leave them, with ties at the row maximum (first argmax wins)."""
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(rows, V, generator=g) * 3
    zt = zs + torch.randn(rows, V, generator=g)
    zs[0, [17, 1500]] = 20.0  # a tie across kernel blocks
    labels = torch.randint(0, V, (rows,), generator=g)
    coef = torch.rand(rows, generator=g) / rows
    return zs.to(dtype), zt.to(dtype), labels, coef


def epilogue_float64(zs, zt, y, coef, grad, terms):
    """The float64 reference of a chunk epilogue: the native kernel's float64 entry point, which
    test_loss.py holds equal to the plain full-logits reference (``test_matches_reference_float64``)."""
    g = torch.empty(zs.shape, dtype=torch.float64) if grad else None
    out = native.chunk_epilogue(zs.double(), None if zt is None else zt.double(), y, coef.double(), g, terms)
    return out, g


_TRITON_RUNS: dict = {}


def triton_epilogue(case: tuple, zs, zt, y, coef, grad: bool, terms):
    """``(row results, G)`` of the Triton epilogue on a chunk, run once per ``case`` (the test's
    parameters but the native build): what it returns does not depend on which native build it is
    compared with, and one run under the interpreter costs about a second of CPU."""
    if case not in _TRITON_RUNS:
        g = torch.empty_like(zs) if grad else None
        _TRITON_RUNS[case] = (kernel.chunk_epilogue(zs, zt.clone(), y, coef, g, terms), g)  # it overwrites zt
    return _TRITON_RUNS[case]


TRUNCATING = {"triton"}  # under the interpreter its fp32 -> bf16 stores truncate (tolerances.g_head_error)


def assert_epilogues_agree(name, zs, zt, y, coef, terms, outs, dtype):
    """Each fast epilogue (``outs``: name -> (row results, G)) within ``tolerances.epilogue_error`` of the
    float64 one, and every two of them within the sum of their bounds (``tolerances.combined``)."""
    ref, g64 = epilogue_float64(zs, zt, y, coef, g64_wanted := any(g is not None for _, g in outs.values()), terms)
    row_error, g_error = tolerances.epilogue_error(zs, zt, coef, terms)
    names = ("lse", "z_y", "s_arg", "t_arg", "entropy", "kl", "accept", "renyi")
    bounds = {}
    for impl, (out, g) in outs.items():
        assert len(out) == len(ref), impl
        for what, x, x64 in zip(names, out, ref):
            if x64.is_floating_point():
                err = (x.double() - x64).abs()
                assert (err <= row_error(x64)).all(), (name, impl, what, err.max().item())
            else:
                assert torch.equal(x, x64), (name, impl, what)
        if g64_wanted:
            bounds[impl] = tolerances.g_head_error(g_error, g64, dtype, truncating=impl in TRUNCATING)
            err = (g.double() - g64).abs()
            assert (err <= bounds[impl]).all(), (name, impl, "G", (err / bounds[impl]).max().item())
    if g64_wanted:  # the fast ones against each other: the sum of their two bounds
        (a, (_, ga)), (b, (_, gb)) = outs.items()
        assert ((ga.double() - gb.double()).abs() <= tolerances.combined(bounds[a], bounds[b])).all(), name


@NATIVE_BUILDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TERMS))
def test_triton_epilogue_matches_the_native_kernel(name, dtype, build):
    """Row terms and G of one chunk, Triton and the native CPU kernel (this CPU's build and the
    baseline instruction set's) on the same raw logits: each against the float64 epilogue, then against
    each other, with the bounds of ``tolerances.epilogue_error``."""
    terms = TERMS[name]
    teacher_labels = terms.label_source == "teacher"
    zs, zt, labels, coef = raw_chunk(dtype)
    y = None if teacher_labels else labels
    g_native = torch.empty_like(zs)
    ref = native.chunk_epilogue(zs, zt, y, coef, g_native, terms)
    out, g_triton = triton_epilogue(("epilogue", name, dtype), zs, zt, y, coef, True, terms)
    assert out[2][0].item() == 17  # the first of the tied maxima
    assert_epilogues_agree(name, zs, zt, y, coef, terms, {"native": (ref, g_native), "triton": (out, g_triton)}, dtype)


PER_ROW_CASES = {  # (kl_weight, T, Tc, scale, softcap, renyi_weight, teacher labels)
    "renyi_no_kl": (0.0, 1.0, 1.0, 1.0, None, 0.7, False),
    "renyi_kl_T1": (0.4, 1.0, 1.0, 1.0, None, 0.5, False),  # e^u serves KL and the per-row terms
    "renyi_kl_tempered_softcap": (0.3, 1.7, 0.8, 0.9, 4.0, 0.6, False),  # the teacher's raw logits are kept
    "acceptance_only_teacher_labels": (0.2, 1.0, 1.3, 1.0, None, 0.0, True),
}


@NATIVE_BUILDS
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(PER_ROW_CASES))
def test_triton_per_row_terms_match_the_native_kernel(name, dtype, grad, build):
    """DSpark's acceptance, Renyi value and G with the Renyi gradient: Triton and the native kernel (both
    builds), each against the float64 epilogue, then against each other (``tolerances.epilogue_error``)."""
    a, temp, tc, scale, cap, beta, teacher_labels = PER_ROW_CASES[name]
    zs, zt, labels, coef = raw_chunk(dtype)
    y = None if teacher_labels else labels
    terms = kernel_terms(a, temp, tc, scale, cap, beta, teacher_labels)
    g_native = torch.empty_like(zs) if grad else None
    ref = native.chunk_epilogue(zs, zt, y, coef, g_native, terms)
    out, g_triton = triton_epilogue(("per-row", name, dtype, grad), zs, zt, y, coef, grad, terms)
    assert len(ref) == len(out) == 8
    assert 0.05 < ref[6].median().item() and ref[6].max().item() < 1.0  # row 0 has an injected tie: its a is tiny
    assert_epilogues_agree(name, zs, zt, y, coef, terms, {"native": (ref, g_native), "triton": (out, g_triton)}, dtype)


DSPARK_CASES = {
    "bias_acceptance": Case(LossTerms(pair_terms=pairs()), bias=True),
    "renyi_kl_cap": Case(LossTerms(kl_weight=0.2, cap_weight=0.1, pair_terms=pairs(renyi=0.4)), bias=True),
    "dpard_tempered_softcap": Case(
        LossTerms(
            kl_weight=0.3, temperature=1.7, softcap=2.5, logit_scale=0.8, pair_terms=pairs(renyi=0.5), credit=dpard()
        ),
        bias=True,
    ),
    # D-PACE's credit comes from each row's lse and z_y, scaled after the kernel like D-PARD's
    "dpace_acceptance_softcap": Case(
        LossTerms(kl_weight=0.3, softcap=2.5, pair_terms=pairs(), credit=dpace()), bias=True
    ),
}


@pytest.mark.parametrize("name", list(DSPARK_CASES))
def test_triton_dspark_terms_float32_match_the_float64_reference(name):
    """The Markov bias, acceptance, Renyi and D-PARD through compile="triton" in fp32 against the
    float64 reference: loss, gradients of the student rows, the bias features and W2, overlap_rows."""
    from test_loss_dspark import _call, assert_within_dspark_bounds
    from test_loss_dspark import make_inputs as dspark_inputs

    case = DSPARK_CASES[name]
    inputs = dspark_inputs(n=40, h=16, v=V, r=6)
    ref, ref_m = _call(reference_draft_loss, case, *inputs)
    wrt = [inputs[0], inputs[5], inputs[6]] if case.bias else [inputs[0]]
    ref_grads = torch.autograd.grad(ref, wrt)
    hs, e, w2 = (x.detach().float().requires_grad_() for x in (inputs[0], inputs[5], inputs[6]))
    ht, w_head, labels, weights = inputs[1].float(), inputs[2].float(), inputs[3], inputs[4].float()
    loss, m = _call(
        fused_draft_loss, case, hs, ht, w_head, labels, weights, e, w2, *inputs[7:], chunk_size=12, compile="triton"
    )
    grads = torch.autograd.grad(loss, [hs, e, w2] if case.bias else [hs])
    term_error = assert_within_dspark_bounds(case, inputs, torch.float32, loss, m, grads, ref, ref_m, ref_grads)
    assert abs(m["renyi"].item() - ref_m["renyi"].item()) <= term_error
