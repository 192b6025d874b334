"""D-PACE and TV against vllm-project/speculators' own loss functions (``speculators.losses``, run in
its venv by tests/external/speculators_loss.py): the loss speculators trains a DFlash drafter with
under ``per_position_loss_weight: dpace``, and its TV term, on the same logits, labels and mask."""

import math

import tolerances
import torch
from external_runner import run_script
from external_venvs import speculators_python
from safetensors.torch import load_file, save_file

from dflash_trainer.loss import BlockCredit, LossTerms, PairTerm, fused_draft_loss

F64 = torch.float64
EPS = 1e-5  # speculators' loss_function divides by sum(loss_mask) + 1e-5 (_LOSS_REDUCTION_EPS)


def test_dpace_and_tv_match_speculators(tmp_path):
    block, blocks, vocab, alpha = 6, 9, 50, 0.4
    t = block * blocks
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(t, vocab, generator=g, dtype=F64) * 2.0
    targets = logits + torch.randn(t, vocab, generator=g, dtype=F64) * 1.5
    labels = targets.argmax(-1)  # speculators' CE labels: the teacher's argmax
    mask = (torch.rand(t, generator=g) < 0.85).to(F64)
    mask[::block] = 0.0  # DFlash: no loss at the anchor slot
    save_file({"logits": logits, "targets": targets, "loss_mask": mask}, tmp_path / "inputs.safetensors")
    run_script(
        speculators_python(), "speculators_loss.py", tmp_path / "inputs.safetensors", tmp_path / "out.safetensors",
        block, alpha,
    )  # fmt: skip
    theirs = load_file(tmp_path / "out.safetensors")

    # ours on the same logits: an identity head turns hidden states into logits exactly
    head = torch.eye(vocab, dtype=F64)
    blocks_ids = torch.arange(t) // block
    dpace = LossTerms(credit=BlockCredit("label_prob", alpha))
    loss, metrics = fused_draft_loss(logits, targets, head, labels, mask, dpace, block_ids=blocks_ids)
    tv = LossTerms(pair_terms=(PairTerm("tv", "overlap", weight=1.0, scale=-1.0, offset=1.0),))
    _, tv_metrics = fused_draft_loss(logits, targets, head, labels, mask, tv)
    n = int(mask.sum())
    ours_dpace = loss.item() * n / (n + EPS)
    ours_tv = tv_metrics["tv"].item() * n / (n + EPS)

    # speculators computes D-PACE's weights in float32 (q = exp(-CE).float()): each weight is a prefix
    # product of <= B factors and a suffix sum of <= B of them, each factor alpha + (1-alpha) q within
    # 3 roundings, so within gamma(4B) relatively; the CE and the reduction stay float64.
    u = tolerances.unit_roundoff(torch.float32)
    dpace_bound = tolerances.gamma(4 * block, torch.float32) * abs(ours_dpace) + 1e-12
    assert abs(ours_dpace - theirs["dpace"].item()) <= dpace_bound, (ours_dpace, theirs["dpace"].item())
    # its TV runs the softmaxes in float32 from logits rounded to float32: each probability within
    # u |z|max + softmax_error relatively, a sum of V minima within that plus gamma(V)
    spread = max((x.amax(-1) - x.amin(-1)).max().item() for x in (logits, targets))
    zmax = max(x.abs().max().item() for x in (logits, targets))
    delta = 2 * u * zmax + tolerances.softmax_error(vocab, spread)
    tv_bound = 2 * delta + tolerances.gamma(vocab, torch.float32) + tolerances.gamma(t, torch.float32)
    assert abs(ours_tv - theirs["tv"].item()) <= tv_bound, (ours_tv, theirs["tv"].item(), tv_bound)
    # the comparison can fail: exp-decay weights give another loss, and TV is far from zero here
    plain, _ = fused_draft_loss(logits, targets, head, labels, mask)
    assert abs(plain.item() - ours_dpace) > 100 * dpace_bound
    assert 0.2 < ours_tv < 0.9 and not math.isclose(ours_tv, metrics["ce"].item())
