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

from test_loss import TERMS, make_inputs  # noqa: E402

from dflash_trainer.loss import fused, fused_draft_loss, native, reference_draft_loss  # noqa: E402

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
    kw = TERMS[name]
    hs64, ht64, w64, labels, weights, _ = make_inputs(n=41, h=16, v=V)
    ref, ref_m = reference_draft_loss(hs64, ht64, w64, labels, weights, **kw)
    (ref_grad,) = torch.autograd.grad(ref, hs64)
    hs = hs64.detach().float().requires_grad_()
    loss, m = fused_draft_loss(
        hs, ht64.float(), w64.float(), labels, weights.float(), chunk_size=7, compile="triton", **kw
    )
    loss.backward()
    assert abs(loss.item() - ref.item()) / abs(ref.item()) < 1e-6, name
    assert (hs.grad.double() - ref_grad).norm().item() / ref_grad.norm().item() < 2e-6, name
    assert hs.grad[weights == 0].abs().max().item() == 0.0
    for key in ("ce", "kl", "cap", "accuracy", "agreement"):
        assert abs(m[key].item() - ref_m[key].item()) < 1e-6 * (1 + abs(ref_m[key].item())), (name, key)
    with torch.no_grad():  # inference: the kernel without its gradient pass
        loss_ng, _ = fused_draft_loss(
            hs, ht64.float(), w64.float(), labels, weights.float(), chunk_size=7, compile="triton", **kw
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TERMS))
def test_triton_epilogue_matches_the_native_kernel(name, dtype):
    """Row terms and G of one chunk, Triton against the native CPU kernel on the same raw logits."""
    t = fused.LossTerms(**{k: v for k, v in TERMS[name].items() if k != "label_source"})
    teacher_labels = TERMS[name].get("label_source") == "teacher"
    zs, zt, labels, coef = raw_chunk(dtype)
    y = None if teacher_labels else labels
    terms = (t.kl_weight, t.temperature, t.cap_temperature, t.logit_scale, t.softcap)
    g_native, g_triton = torch.empty_like(zs), torch.empty_like(zs)
    ref = native.chunk_epilogue(zs, zt, y, coef, g_native, *terms)
    out = kernel.chunk_epilogue(zs, zt.clone(), y, coef, g_triton, *terms)  # the kernel overwrites zt with KL
    for what, a, b in zip(("lse", "z_y", "s_arg", "t_arg", "entropy", "kl"), ref, out):
        if a.is_floating_point():
            assert (a - b).abs().max().item() < 2e-5 * (1 + a.abs().max().item()), (name, what)
        else:
            assert torch.equal(a, b), (name, what)
    assert out[2][0].item() == 17  # the first of the tied maxima
    # Both compute in fp32 (different exp and summation order), then round G to the head dtype: bf16 values
    # may land on either side of a rounding boundary, one bf16 step (2^-7 relative) at the most.
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    scale = g_native.float().abs().amax(1, keepdim=True)
    assert ((g_native.float() - g_triton.float()).abs() / scale).max().item() < tol, name
