"""The on-policy stage (``train.stage=on_policy``, Draft-OPD): the drafter learns from its own rounds.

Per packed row of the stream (row ``g``), in place of the SFT producer:

    prompt   = the row's first document up to its first loss position (the user turn)
    rollout  = speculative decoding of the prompt by the target with the current drafter, chain or
               DDTree verification (``on_policy.rollout``), greedy (``on_policy.temperature`` 0) or
               lossless sampling at T (seeded by (train.seed, g)), recording every round: its anchor,
               drafts, accepted count and (chain) the target's final hidden states over the block, from
               the verification pass itself
    features = one target pass over prompt + generated text: the drafter's context rows, and the
               teacher rows along the text
    batch    = the drafter over one block per round, anchored where the round began: the state decoding
               put it in, not a sampled position of a target-written text
    loss     = loss.on_policy_loss: forward KL on the slots the target accepted, reverse KL on the rejected

The teacher of slot k (``on_policy.teacher``): "text" (the default) is the target's state at anchor +
k - 1 along the decoded text, the continuation acceptance is judged on (slot k counts only when slots
1..k-1 were accepted, that is when the drafts before it were the text's tokens); "verified" is the
verification pass's state after the anchor and drafts 1..k-1 as proposed, which past the first rejected
slot conditions on a wrong draft (the paper's replayed states: its drafter is autoregressive, so its
later drafts do depend on the earlier ones; a DFlash block's slots do not). Up to the first rejected
slot the two are the same states (tested). benchmarks/bench_on_policy.py measures both.

Slot weights: an accepted slot k gets the SFT decay ``exp(-(k-1)/gamma)``; a rejected slot k of a round
that accepted ``a`` drafts gets ``exp(-(k-1-a)/gamma)``: 1 at the first rejection, where the round
ended, decaying after it. Slot 0 (the anchor) has no loss, nor has a slot past the decoded text.

DDTree rollouts (``on_policy.rollout=ddtree``): a round's accepted slots are its accepted path's, and
the signal is that path, as for a chain: the text teacher at every slot, forward KL up to the path's
depth, reverse KL past it. The rejected siblings add no row of their own, by choice: a DFlash slot has
one distribution whatever the drafts before it, so a sibling at depth d is a candidate for the same
slot d under the same teacher state as the path's node there (its rejection is already in that row's
KL, which weighs every token the drafter proposes), and a sibling's subtree states follow a token the
target rejected, the off-text conditioning the verified teacher measured worse with.
What the tree changes is where rounds start and which slots count as accepted: it accepts a slot whose
text token was any candidate the drafter ranked into the tree, as DDTree serving does.

Where this differs from the paper: its drafter is autoregressive (replayed states are its teacher; here
the text's, by default); DDTree rollouts as above. The rollouts run where the target is: in the training
process, or on target ranks drafting with the weights the drafter rank broadcasts before each step
(``distributed.run_target_rank``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import RunConfig
from ..data.packing import PackedRow, document_spans
from ..inference.sampling import GreedyVerification, SampledVerification
from ..inference.speculative import SpeculativeDecoder
from ..loss import on_policy_loss
from ..model.drafter import DFlashDrafter
from ..model.target import RowFeatures, TargetModel
from .step import drafter_step, loss_head, phase, row_generator


@dataclass
class Rollout:
    """One prompt decoded by the target with the drafter (n recorded rounds, block size B, L tokens)."""

    input_ids: torch.Tensor  # [L] prompt + generated tokens + B padding tokens (every block fits)
    position_ids: torch.Tensor  # [L]
    loss_mask: torch.Tensor  # [L] 1 on the generated tokens
    anchors: torch.Tensor  # [n] anchor position of each round
    # [n*B, H] the verification pass's final hidden predicting slot k (row k = 0: zeros, no loss); only
    # with on_policy.teacher "verified" (the text teacher is read from the features pass instead)
    teacher: torch.Tensor | None
    accepted: torch.Tensor  # [n*B] bool: slot k <= the round's accepted count
    weights: torch.Tensor  # [n*B] slot weights (module docstring), 0 at slot 0
    accepted_counts: list[int]  # [n]
    drafts: list[list[int]]  # [n][B-1] each round's proposed (greedy) chain
    target_tokens: int  # tokens the target ran for this rollout (prompt, verifications, replays)

    @property
    def tau(self) -> float:
        return sum(a + 1 for a in self.accepted_counts) / max(1, len(self.accepted_counts))


def row_prompt(row: PackedRow) -> list[int] | None:
    """The prompt of a packed row: its first document up to the first position with loss (None when
    that document has no loss position, or no token before it)."""
    start, end = document_spans(row.position_ids)[0]
    loss = row.loss_mask[start:end].nonzero()
    if loss.numel() == 0 or int(loss[0]) == 0:
        return None
    return row.input_ids[start : start + int(loss[0])].tolist()


def slot_weights(accepted: int, block: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [B] bool, weights [B])`` of one round that accepted ``accepted`` drafts."""
    k = torch.arange(block, dtype=torch.float64)
    is_accepted = (k >= 1) & (k <= accepted)
    decay_from = torch.where(is_accepted, k - 1, k - 1 - accepted)
    weights = torch.exp(-decay_from / gamma)
    weights[0] = 0.0
    return is_accepted, weights.float()


@torch.no_grad()
def collect_rollout(
    target: TargetModel, drafter: DFlashDrafter, prompt: list[int], eos: list[int], cfg: RunConfig, row_index: int
) -> Rollout | None:
    """Decode ``prompt`` (``on_policy.max_new_tokens``) with the drafter in eval mode (restored after);
    None when no round was verified. The sampling seed is a function of ``(train.seed, row_index)``."""
    op, block = cfg.on_policy, drafter.spec.block_size
    if op.temperature > 0:
        seed = int(torch.randint(0, 2**62, (1,), generator=row_generator(cfg.train.seed, row_index)))
        policy = SampledVerification(op.temperature, op.top_p, seed)
    else:
        policy = GreedyVerification()
    was_training = drafter.training
    decoder = SpeculativeDecoder(target, drafter, eos)
    try:
        result = decoder.generate(prompt, op.max_new_tokens, op.rollout, budget=op.budget, policy=policy, record=True)
    finally:
        drafter.train(was_training)
    text = prompt + result.tokens
    rounds = [r for r in result.rounds if r.anchor_pos < len(text)]  # the last round may be cut at eos
    if not rounds:
        return None
    teacher = None
    if op.teacher == "verified":
        hidden = rounds[0].teacher.shape[-1]
        teacher = torch.zeros(len(rounds), block, hidden, dtype=rounds[0].teacher.dtype)
        for i, r in enumerate(rounds):
            teacher[i, 1 : 1 + len(r.drafts)] = r.teacher.cpu()  # slot k's teacher: state after drafts < k
        teacher = teacher.reshape(-1, hidden)
    accepted, weights = [], []
    for r in rounds:
        acc, w = slot_weights(r.accepted, block, cfg.loss.gamma)
        w[1 + len(r.drafts) :] = 0.0  # a shorter chain than the block: no teacher there
        accepted.append(acc)
        weights.append(w)
    ids = torch.tensor(text + [eos[0]] * block)
    loss_mask = torch.zeros_like(ids)
    loss_mask[len(prompt) : len(text)] = 1
    return Rollout(
        input_ids=ids,
        position_ids=torch.arange(ids.numel()),
        loss_mask=loss_mask,
        anchors=torch.tensor([r.anchor_pos for r in rounds]),
        teacher=teacher,
        accepted=torch.cat(accepted),
        weights=torch.cat(weights),
        accepted_counts=[r.accepted for r in rounds],
        drafts=[r.drafts for r in rounds],
        target_tokens=decoder.target_tokens,
    )


def rollout_features(target: TargetModel, rollout: Rollout, cfg: RunConfig, n: int) -> tuple[RowFeatures, torch.Tensor]:
    """``(RowFeatures of the first n rounds, their slot weights [n*B])``: one target pass over the
    rollout's text gives the context rows, and with ``on_policy.teacher`` "text" the teacher rows too:
    slot k's at ``anchor + k - 1`` along the decoded text (a slot past its end gets weight 0); with
    "verified" the teacher rows are the verification pass's (``Rollout.teacher``)."""
    block, dev = cfg.drafter.block_size, target.device
    ids, pos, mask = rollout.input_ids.to(dev), rollout.position_ids.to(dev), rollout.loss_mask.to(dev)
    anchors = rollout.anchors[:n].to(dev)
    text_teacher = cfg.on_policy.teacher == "text"
    with phase("target forward"):
        full = target.features(ids, pos, need_teacher=text_teacher)
    weights = rollout.weights[: n * block].to(dev)
    if text_teacher:
        index = (anchors[:, None] + torch.arange(block, device=dev) - 1).clamp(min=0).reshape(-1)
        teacher = full.last_hidden[index]
        weights = weights * mask[(index + 1).clamp(max=ids.numel() - 1)]  # padding has no continuation
    else:
        teacher = rollout.teacher[: n * block].to(dev)
    return RowFeatures(ids, pos, mask, anchors, full.context, teacher), weights


@dataclass
class RolloutRow:
    """What the drafter trains on from one rollout (``rollout_row``): in one process a plain value, with
    target ranks what a target rank sends to the drafter rank (``distributed.pack_rollout``)."""

    features: RowFeatures  # the first n rounds' blocks, n <= data.max_anchors: context [L, k*H], teacher [n*B, H]
    accepted: torch.Tensor  # [n*B] bool
    weights: torch.Tensor  # [n*B] slot weights
    tau: float  # the rollout's acceptance (all its rounds)
    target_tokens: int  # tokens the target ran for the rollout


def rollout_row(target: TargetModel, rollout: Rollout, cfg: RunConfig) -> RolloutRow:
    """The target's side of a rollout's training row: its first ``data.max_anchors`` rounds' features."""
    n = min(rollout.anchors.numel(), cfg.data.max_anchors)
    feats, weights = rollout_features(target, rollout, cfg, n)
    accepted = rollout.accepted[: n * cfg.drafter.block_size].to(weights.device)
    return RolloutRow(feats, accepted, weights, rollout.tau, rollout.target_tokens)


def produce_rollout_row(
    target: TargetModel, drafter: DFlashDrafter, row: PackedRow, eos: list[int], cfg: RunConfig, row_index: int
) -> RolloutRow | None:
    """The producer of the on-policy stage, as ``step.produce_row_features`` is SFT's: stream row
    ``row_index``'s prompt decoded with ``drafter`` and its training row; None when the row has no
    prompt or decoding verified no round."""
    prompt = row_prompt(row)
    if prompt is None:
        return None
    with phase("rollout"):
        rollout = collect_rollout(target, drafter, prompt, eos, cfg, row_index)
    return None if rollout is None else rollout_row(target, rollout, cfg)


def on_policy_row(drafter: DFlashDrafter, row: RolloutRow, cfg: RunConfig, forward=None) -> tuple[torch.Tensor, dict]:
    """``(loss, metrics)`` of one rollout's row: its rounds' blocks through the drafter, and the on-policy
    loss. Metrics: ``forward_kl``, ``reverse_kl``, ``agreement``, ``rollout_tau`` (of all its rounds)
    and ``accepted_share`` (of the slots with loss)."""
    nb, block = cfg.data.max_anchors, drafter.spec.block_size
    n = row.features.anchors.numel()
    batch = drafter_step(drafter, row.features, cfg, train=True, forward=forward)
    accepted = torch.zeros(nb * block, dtype=torch.bool, device=batch.hidden.device)
    weights = torch.zeros(nb * block, device=batch.hidden.device)
    accepted[: n * block] = row.accepted.to(accepted.device)
    weights[: n * block] = row.weights.to(weights.device)
    head = loss_head(drafter, cfg)
    with phase("loss"):
        loss, m = on_policy_loss(
            batch.hidden.to(head.dtype),
            batch.teacher.to(head.dtype),
            head,
            accepted,
            weights,
            temperature=cfg.on_policy.kl_temperature,
            chunk_size=cfg.loss.chunk_size,
            logit_options=drafter.spec.logit_options,
        )
    rows = m["accepted_rows"] + m["rejected_rows"]
    metrics = {
        "forward_kl": m["forward_kl"],
        "reverse_kl": m["reverse_kl"],
        "agreement": m["agreement"],
        "rollout_tau": torch.tensor(row.tau),
        "accepted_share": m["accepted_rows"] / rows.clamp(min=1),
    }
    return loss, metrics
