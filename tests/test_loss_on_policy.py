"""The on-policy stage's loss (loss/on_policy.py) against a reference written out here in float64: full
logits, the forward KL on accepted rows and the reverse KL on rejected rows as their definitions write
them, autograd for the gradient; the reverse-KL row term and the CE/KL blend's weight (``base_weight``)
it is built from, against the plain reference (loss/reference.py) in every implementation; and no
``[N, V]`` tensor anywhere in its forward or backward pass."""

import pytest
import tolerances
import torch
import torch.nn.functional as F
from kernel_builds import COMPILED
from test_loss import OpRecorder

from dflash_trainer.loss import LossTerms, PairTerm, fused_draft_loss, on_policy_loss, reference_draft_loss

F64 = torch.float64
N, H, V, BLOCK = 40, 16, 60, 5
# Two float64 evaluations of the same sums in another order: logits are dot products of length H, each
# row's softmax and KL sum V terms; float64_forward_error's rule for one layer of inner length H + V
# (about 2e-11 relative). A wrong row set, direction of the KL, temperature or weight moves the loss and
# its gradient by 1e-3 relative or more.
BOUND = tolerances.float64_forward_error(layers=1, inner=H + V)


def make_inputs(seed=0):
    """Rollout rows of 8 blocks: slot 0 without loss, slots accepted up to a per-block cut, the rest
    rejected; weights decay with the slot."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, H, generator=g, dtype=F64).requires_grad_()
    ht = hs.detach() + 0.7 * torch.randn(N, H, generator=g, dtype=F64)
    w_head = torch.randn(V, H, generator=g, dtype=F64) * 0.6
    slots = torch.arange(N) % BLOCK
    cut = torch.randint(0, BLOCK, (N // BLOCK,), generator=g).repeat_interleave(BLOCK)
    accepted = (slots >= 1) & (slots <= cut)
    weights = torch.exp(-(slots.to(F64) - 1) / 4.0)
    weights[slots == 0] = 0.0
    return hs, ht, w_head, accepted, weights, slots


def written_out(hs, ht, w_head, accepted, weights, temperature):
    """The on-policy loss as its definition writes it: full [N, V] logits, float64, autograd."""
    zs, zt = hs @ w_head.T, ht @ w_head.T
    log_p_t, log_q_t = F.log_softmax(zs / temperature, -1), F.log_softmax(zt / temperature, -1)
    forward = temperature**2 * (log_q_t.exp() * (log_q_t - log_p_t)).sum(-1)  # T^2 KL(q^T || p^T)
    log_p, log_q = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    reverse = (log_p.exp() * (log_p - log_q)).sum(-1)  # KL(p || q)
    rows = torch.where(accepted, forward, reverse)
    return (weights * rows).sum() / weights.sum(), forward, reverse


@COMPILED
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_on_policy_loss_matches_the_written_out_loss_float64(compiled, temperature):
    hs, ht, w_head, accepted, weights, slots = make_inputs()
    loss, metrics = on_policy_loss(
        hs, ht, w_head, accepted, weights, temperature=temperature, slot_ids=slots, num_slots=BLOCK,
        chunk_size=7, compile=compiled,
    )  # fmt: skip
    want, forward, reverse = written_out(hs, ht, w_head, accepted, weights, temperature)
    (grad,) = torch.autograd.grad(loss, hs)
    (want_grad,) = torch.autograd.grad(want, hs)
    assert abs(loss.item() - want.item()) <= BOUND * abs(want.item())
    assert (grad - want_grad).abs().max().item() <= BOUND * want_grad.abs().max().item()
    assert grads_vanish_where(grad, weights == 0)
    has_acc, has_rej = accepted & (weights > 0), ~accepted & (weights > 0)
    assert has_acc.any() and has_rej.any()  # both kinds of rows are in the case
    f_mean = forward[has_acc].mean() / temperature**2
    assert abs(metrics["forward_kl"].item() - f_mean.item()) <= BOUND * f_mean.item()
    assert abs(metrics["reverse_kl"].item() - reverse[has_rej].mean().item()) <= BOUND * reverse[has_rej].mean().item()
    assert metrics["accepted_rows"].item() == has_acc.sum().item()
    assert metrics["rejected_rows"].item() == has_rej.sum().item()
    per_slot = metrics["per_slot"]
    assert per_slot["accepted_rows"][0].item() == per_slot["rejected_rows"][0].item() == 0  # slot 0: no loss
    assert torch.equal(
        per_slot["accepted_rows"] + per_slot["rejected_rows"], torch.tensor([0.0, 8, 8, 8, 8], dtype=F64)
    )


def grads_vanish_where(grad, mask) -> bool:
    return grad[mask].abs().max().item() == 0.0


def test_every_row_accepted_or_rejected_is_the_plain_forward_or_reverse_kl():
    """The two ends: all rows accepted is the soft-KL-only SFT loss (kl_weight 1), all rejected the reverse
    KL, here read from torch's own kl_div (``kl_div(log q, log p, log_target=True)`` = KL(p || q))."""
    hs, ht, w_head, _, weights, _ = make_inputs(seed=1)
    every = torch.ones(N, dtype=torch.bool)
    loss, _ = on_policy_loss(hs, ht, w_head, every, weights, temperature=1.3, compile=False)
    sft, _ = reference_draft_loss(
        hs, ht, w_head, None, weights, LossTerms(kl_weight=1.0, temperature=1.3, label_source="teacher")
    )
    assert abs(loss.item() - sft.item()) <= BOUND * sft.item()
    loss, _ = on_policy_loss(hs, ht, w_head, ~every, weights, compile=False)
    log_p, log_q = F.log_softmax(hs @ w_head.T, -1), F.log_softmax(ht @ w_head.T, -1)
    rows = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    want = (weights * rows).sum() / weights.sum()
    assert abs(loss.item() - want.item()) <= BOUND * want.item()
    # the two KLs differ on these rows (the direction matters: the test would see a swap)
    assert abs(loss.item() - on_policy_loss(hs, ht, w_head, every, weights, compile=False)[0].item()) > 1e-3


REVERSE_CASES = {
    "reverse_only": LossTerms(base_weight=0.0, pair_terms=(PairTerm("rkl", "reverse_kl", weight=1.0),)),
    "reverse_metric_with_ce": LossTerms(pair_terms=(PairTerm("rkl", "reverse_kl"),)),
    "half_blend_reverse_renyi_cap": LossTerms(
        base_weight=0.5,
        kl_weight=0.3,
        temperature=1.7,
        cap_weight=0.2,
        pair_terms=(PairTerm("rkl", "reverse_kl", weight=0.6), PairTerm("renyi", "renyi_half", weight=0.4)),
    ),
    "reverse_softcap_teacher_labels": LossTerms(
        label_source="teacher",
        softcap=2.5,
        logit_scale=0.8,
        pair_terms=(PairTerm("rkl", "reverse_kl", weight=0.7, scale=2.0, offset=0.1),),
    ),
}


@COMPILED
@pytest.mark.parametrize("name", list(REVERSE_CASES))
def test_reverse_kl_term_and_base_weight_match_the_reference_float64(name, compiled):
    terms = REVERSE_CASES[name]
    hs, ht, w_head, _, weights, slots = make_inputs(seed=2)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    loss, metrics = fused_draft_loss(
        hs, ht, w_head, labels, weights, terms, slot_ids=slots, num_slots=BLOCK, chunk_size=9, compile=compiled
    )
    ref, ref_metrics = reference_draft_loss(hs, ht, w_head, labels, weights, terms)
    (grad,) = torch.autograd.grad(loss, hs)
    (ref_grad,) = torch.autograd.grad(ref, hs)
    assert abs(loss.item() - ref.item()) <= BOUND * max(1.0, abs(ref.item()))
    assert (grad - ref_grad).abs().max().item() <= BOUND * max(1.0, ref_grad.abs().max().item())
    assert grads_vanish_where(grad, weights == 0)
    assert abs(metrics["rkl"].item() - ref_metrics["rkl"].item()) <= BOUND * max(1.0, ref_metrics["rkl"].item())
    assert metrics["per_slot"]["rkl"].shape == (BLOCK,)


def test_terms_route_to_the_eager_passes_only_where_the_kernels_fall_short():
    assert LossTerms(kl_weight=1.0).kernel_ready
    assert not LossTerms(base_weight=0.5).kernel_ready
    assert not LossTerms(pair_terms=(PairTerm("rkl", "reverse_kl"),)).kernel_ready  # a metric only, still eager
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="base_weight must be in"):
            LossTerms(base_weight=bad)
    hs, ht, w_head, accepted, weights, _ = make_inputs()
    with pytest.raises(ValueError, match="accepted must be a bool tensor shaped like weights"):
        on_policy_loss(hs, ht, w_head, accepted.long(), weights)


@pytest.mark.parametrize("compiled", [False, "native"])
def test_on_policy_loss_never_allocates_positions_by_vocab(compiled):
    n, h, v = 2048, 64, 32000
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ht = torch.randn(n, h, generator=g)
    w_head = torch.randn(v, h, generator=g) * 0.1
    accepted = torch.rand(n, generator=g) < 0.5
    with OpRecorder() as rec:
        loss, _ = on_policy_loss(hs, ht, w_head, accepted, torch.ones(n), chunk_size=256, compile=compiled)
        loss.backward()
    assert rec.largest < n * v, f"a tensor with {rec.largest} elements (N x V = {n * v}) was allocated"
    assert rec.largest <= 256 * v
    assert torch.isfinite(hs.grad).all() and hs.grad.abs().max() > 0
