"""DSpark's loss terms in the fused loss against the plain reference (float64): the Markov bias folded
into the chunked head GEMM (gradients of the features and of W2), acceptance, Renyi-1/2, D-PARD."""

import pytest
import torch

from dflash_trainer.loss import fused_draft_loss, reference_draft_loss
from dflash_trainer.loss.fused import _chunk_bounds

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


CASES = {
    "bias_ce": dict(bias=True),
    "bias_kl_cap": dict(bias=True, kl_weight=0.3, temperature=1.7, cap_weight=0.2),
    "bias_softcap": dict(bias=True, kl_weight=0.2, cap_weight=0.3, softcap=2.5, logit_scale=0.8),
    "acceptance": dict(acceptance=True, kl_weight=0.5),
    "renyi": dict(renyi_weight=0.7),
    "renyi_bias_cap": dict(bias=True, renyi_weight=0.4, kl_weight=0.2, cap_weight=0.1),
    "dpard": dict(dpard=True, dpard_alpha=0.5, kl_weight=1.0),
    "dspark_all": dict(bias=True, renyi_weight=0.5, dpard=True, dpard_alpha=0.3, kl_weight=0.4, cap_weight=0.1),
    "teacher_labels": dict(bias=True, renyi_weight=0.3, label_source="teacher", acceptance=True),
}


def _call(fn, case, hs, ht, w_head, labels, weights, e, w2, slots, blocks, **extra):
    kw = {k: v for k, v in case.items() if k != "bias"}
    if case.get("bias"):
        kw.update(bias_rows=e, bias_weight=w2)
    if case.get("dpard"):
        kw.update(block_ids=blocks)
    return fn(hs, ht, w_head, labels, weights, **kw, **extra)


@pytest.mark.parametrize("compiled", [False, "native"], ids=["eager", "native"])
@pytest.mark.parametrize("name", list(CASES))
def test_dspark_terms_match_reference_float64(name, compiled):
    case = CASES[name]
    inputs = make_inputs()
    hs, e, w2, weights = inputs[0], inputs[5], inputs[6], inputs[4]
    loss, metrics = _call(
        fused_draft_loss, case, *inputs, chunk_size=12, compile=compiled, slot_ids=inputs[7], num_slots=5
    )
    ref_loss, ref_metrics = _call(reference_draft_loss, case, *inputs)
    wrt = [hs] + ([e, w2] if case.get("bias") else [])
    grads = torch.autograd.grad(loss, wrt)
    ref_grads = torch.autograd.grad(ref_loss, wrt)
    assert abs(loss.item() - ref_loss.item()) < 1e-10
    for g, rg in zip(grads, ref_grads):
        assert (g - rg).abs().max().item() < 1e-10
    assert grads[0][weights == 0].abs().max().item() == 0.0
    for key in ("ce", "kl", "cap", "accuracy"):
        assert abs(metrics[key].item() - ref_metrics[key].item()) < 1e-10, key
    if "accept" in ref_metrics:
        assert (metrics["accept_rows"] - ref_metrics["accept_rows"]).abs().max().item() < 1e-12
        assert abs(metrics["renyi"].item() - ref_metrics["renyi"].item()) < 1e-10
        assert metrics["per_slot"]["accept"].shape == (5,)
        assert 0.0 < metrics["accept"].item() < 1.0


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
    assert abs(loss.item() - base.item()) < 1e-12


def test_chunk_bounds_keep_blocks_whole():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3, 4])
    bounds = _chunk_bounds(13, 4, ids)
    assert [(b.start, b.stop) for b in bounds] == [(0, 3), (3, 6), (6, 12), (12, 13)]
    assert _chunk_bounds(5, 2, None) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_bad_dspark_arguments():
    hs, ht, w_head, labels, weights, e, w2, _, blocks = make_inputs()
    with pytest.raises(ValueError, match="teacher_hidden"):
        fused_draft_loss(hs, None, w_head, labels, weights, renyi_weight=1.0)
    with pytest.raises(ValueError, match="block_ids"):
        fused_draft_loss(hs, ht, w_head, labels, weights, dpard=True)
    with pytest.raises(ValueError, match="bias_weight"):
        fused_draft_loss(hs, ht, w_head, labels, weights, bias_rows=e, bias_weight=w2[:5])


@pytest.mark.parametrize("compiled", [False, "native"], ids=["eager", "native"])
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
    per_row = dict(renyi_weight=0.5, dpard=True, block_ids=torch.arange(n) // 16) if compiled is False else {}
    with OpRecorder() as rec:
        loss, _ = fused_draft_loss(
            hs,
            ht,
            w_head,
            labels,
            weights,
            kl_weight=0.5,
            cap_weight=0.1,
            chunk_size=256,
            compile=compiled,
            bias_rows=e,
            bias_weight=w2,
            **per_row,
        )
        loss.backward()
    assert rec.count("addmm") + rec.count("addmm_") >= n // 256  # the bias GEMM ran chunk by chunk
    assert rec.largest < n * v, f"a tensor with {rec.largest} elements (N x V = {n * v}) was allocated"
    assert rec.largest <= 256 * v
    assert torch.isfinite(w2.grad).all() and w2.grad.abs().max() > 0
