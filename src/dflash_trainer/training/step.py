"""One training step, cut where the processes split (shared/DESIGN.md sections 4 and 4b).

    producer (target side):   produce_row_features(target, row, row_index, cfg) -> RowFeatures | None
                              anchors from a generator seeded by (train.seed, global row index), then
                              context features [L, k*H] and teacher rows [n*B, H] at the blocks only
    consumer (drafter side):  drafter_step(drafter, features, cfg) -> StepBatch
                              blocks padded to max_anchors, one masked drafter pass  [nb*B, H]
                              draft_loss(drafter, batch, cfg)  (the fused loss; head and its logit
                              options come from the drafter, which holds the target's head)

In one process the two halves are plain calls; with torch.distributed, ``RowFeatures`` is what
crosses from a target rank to a drafter rank. Because anchors depend only on the seed and the row's
global index, a run's numbers do not depend on how many processes produce rows. Phases are marked
with ``torch.profiler.record_function`` (``target_forward``, ``drafter_forward``, ``loss``), which
the planner's calibration tool reads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from ..config import RunConfig
from ..data.blocks import build_blocks, sample_anchors
from ..data.packing import PackedRow, doc_ids_from_positions
from ..loss import BlockCredit, LossTerms, PairTerm
from ..model.drafter import DFlashDrafter
from ..model.target import RowFeatures, TargetModel
from ..variants import variant_of

PHASE_PREFIX = "dflash-phase:"


def phase(name: str) -> record_function:
    """A profiler range for one phase of the step (no cost unless a profiler is recording)."""
    return record_function(PHASE_PREFIX + name)


def needs_teacher(cfg: RunConfig) -> bool:
    """The loss reads the teacher's hidden states (soft KL, teacher-argmax labels, or a term of the
    drafter variant's that needs them)."""
    if loss_terms(cfg, {}).needs_teacher:
        return True
    return variant_of(cfg.drafter.variant).needs_teacher(cfg.drafter.variant_settings)


def row_generator(seed: int, row_index: int) -> torch.Generator:
    """The anchor generator of one row: a function of ``(seed, global row index)`` only."""
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + row_index * 0x85EBCA77 + 1) % (1 << 63))


@contextlib.contextmanager
def row_rng(seed: int, row_index: int, device: torch.device):
    """The global RNG seeded by ``(seed, global row index)`` for one row's drafter pass (feature noise),
    then restored: the noise a row gets does not depend on which process trains on it."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((seed * 0x9E3779B1 + row_index * 0x2545F491 + 3) % (1 << 63))
        yield


def row_anchors(row: PackedRow, row_index: int, cfg: RunConfig) -> torch.Tensor:
    """The sorted anchor positions ``[n]`` of row ``row_index`` (n <= data.max_anchors; 0 when none is valid)."""
    doc = doc_ids_from_positions(row.position_ids)
    gen = row_generator(cfg.train.seed, row_index)
    return sample_anchors(row.loss_mask, doc, cfg.drafter.block_span, cfg.data.max_anchors, gen)


def produce_row_features(target: TargetModel, row: PackedRow, row_index: int, cfg: RunConfig) -> RowFeatures | None:
    """The producer half: anchors of row ``row_index`` and the target features they need; None when
    the row has no valid anchor (nothing for the drafter to learn from it)."""
    block = cfg.drafter.block_span  # B, plus the variant's label shift
    anchors = row_anchors(row, row_index, cfg)
    if anchors.numel() == 0:
        return None
    # Anchors are drawn where the row is (the CPU generator gives the same anchors on any device); the
    # row's tensors then go where the target is, and everything downstream follows them.
    dev = target.device
    ids, pos, mask, anchors = (t.to(dev) for t in (row.input_ids, row.position_ids, row.loss_mask, anchors))
    with phase("target forward"):
        return target.row_features(ids, pos, mask, anchors, block, needs_teacher(cfg))


@dataclass
class StepBatch:
    """What one packed row contributes to the loss (all rows of its blocks, flattened)."""

    hidden: torch.Tensor  # [nb*B, H] drafter output
    teacher: torch.Tensor | None  # [nb*B, H] target final-normed hidden at anchor + k - 1 (0 on padding)
    labels: torch.Tensor  # [nb*B]
    weights: torch.Tensor  # [nb*B]
    slots: torch.Tensor  # [nb*B] slot index k
    extras: dict = field(default_factory=dict)  # the drafter variant's per-row tensors (batch_extras)


def drafter_step(
    drafter: DFlashDrafter, feats: RowFeatures, cfg: RunConfig, *, train: bool = True, forward=None
) -> StepBatch:
    """The consumer half up to the loss: blocks of ``feats``' anchors, padded with weight-0 blocks to
    ``data.max_anchors`` (stable shapes from step to step), and the drafter's output over all of them.
    ``forward`` runs the drafter (default ``drafter``; a DDP wrapper of it on data-parallel ranks)."""
    spec, nb = drafter.spec, cfg.data.max_anchors
    variant = variant_of(spec)
    b, n = spec.block_size, feats.anchors.numel()
    # Slot k predicts the token at anchor + k + shift: blocks are laid out over B + shift row tokens,
    # the drafter reads the first B (anchor, masks) and the loss the last B (labels, weights, teacher).
    shift = variant.label_shift(spec)
    doc = doc_ids_from_positions(feats.position_ids)
    blocks = build_blocks(
        feats.input_ids,
        feats.position_ids,
        feats.loss_mask,
        feats.anchors,
        block_size=b + shift,
        mask_token_id=spec.mask_token_id,
        gamma=cfg.loss.gamma,
        num_blocks=nb,
    )
    backend = cfg.drafter.attention_backend
    masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, backend)
    autocast = torch.autocast(feats.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.train.dtype == "bfloat16")
    with phase("drafter forward"), autocast, torch.set_grad_enabled(train):
        hidden = (forward or drafter)(
            blocks.input_ids[:, :b], blocks.position_ids[:, :b], feats.context, feats.position_ids, masks, backend
        )
    teacher = None
    if feats.teacher is not None:  # padding blocks have weight 0: the loss never reads their teacher rows
        width = feats.teacher.shape[-1]
        teacher = feats.teacher.new_zeros(nb * b, width)
        teacher[: n * b] = feats.teacher.view(n, b + shift, width)[:, shift:].reshape(n * b, width)
    return StepBatch(
        hidden=hidden,
        teacher=teacher,
        labels=blocks.labels[:, shift:].reshape(-1),
        weights=blocks.weights[:, shift:].reshape(-1),
        slots=torch.arange(b, device=hidden.device).repeat(nb),
        extras=variant.batch_extras(spec, feats.input_ids, blocks.anchors),
    )


def loss_head(drafter: DFlashDrafter, cfg: RunConfig) -> torch.Tensor:
    """The head ``[V, H]`` the loss multiplies by: the drafter's (the target's), detached, in bf16 under
    ``train.dtype=bfloat16`` (like autocast's matmuls; an fp32 head is cast per step)."""
    head = drafter.lm_head_weight.detach()
    return head.to(torch.bfloat16) if cfg.train.dtype == "bfloat16" else head


def draft_loss(drafter: DFlashDrafter, batch: StepBatch, cfg: RunConfig, *, reference: bool = False):
    """``(loss, metrics)`` of one row's blocks: the fused loss, or the plain reference for benchmarks.
    The head and its logit transform are the drafter's (the target's, held by the drafter; ``loss_head``):
    under ``train.dtype=bfloat16`` the head GEMMs run in bf16, while the loss's logits, softmax and
    gradient stay fp32."""
    head = loss_head(drafter, cfg)
    hidden = batch.hidden.to(head.dtype)
    teacher = batch.teacher.to(head.dtype) if batch.teacher is not None else None
    terms = loss_terms(cfg, drafter.spec.logit_options)
    options = {"chunk_size": cfg.loss.chunk_size}
    with phase("loss"):
        return variant_of(drafter.spec).loss(drafter, hidden, teacher, head, batch, terms, options, reference=reference)


def loss_terms(cfg: RunConfig, logit_options: dict) -> LossTerms:
    """The run's base loss terms (``loss.*``; a variant adds its own in ``Variant.loss``) with the
    target's logit transform ``logit_options`` (``DrafterSpec.logit_options``)."""
    pair_terms = ()
    if cfg.loss.tv_weight > 0:  # total variation 1 - overlap = 0.5 sum_v |p_v - q_v|
        pair_terms = (PairTerm("tv", "overlap", weight=cfg.loss.tv_weight, scale=-1.0, offset=1.0),)
    credit = BlockCredit("label_prob", cfg.loss.dpace_alpha) if cfg.loss.position_weights == "dpace" else None
    return LossTerms(
        kl_weight=cfg.loss.kl_weight,
        temperature=cfg.loss.temperature,
        cap_weight=cfg.loss.cap_weight,
        cap_temperature=cfg.loss.cap_temperature,
        label_source=cfg.loss.labels,
        pair_terms=pair_terms,
        credit=credit,
        **logit_options,
    )
