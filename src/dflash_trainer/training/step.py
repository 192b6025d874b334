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
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..config import RunConfig
from ..data.blocks import build_blocks, sample_anchors
from ..data.packing import PackedRow, doc_ids_from_positions
from ..loss import fused_draft_loss, reference_draft_loss
from ..model.drafter import DFlashDrafter
from ..model.target import RowFeatures, TargetModel

PHASE_PREFIX = "dflash-phase:"


def phase(name: str) -> record_function:
    """A profiler range for one phase of the step (no cost unless a profiler is recording)."""
    return record_function(PHASE_PREFIX + name)


def needs_teacher(cfg: RunConfig) -> bool:
    """The loss reads the teacher's hidden states (soft KL, or teacher-argmax labels)."""
    return cfg.loss.kl_weight > 0 or cfg.loss.labels == "teacher"


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
    return sample_anchors(row.loss_mask, doc, cfg.drafter.block_size, cfg.data.max_anchors, gen)


def produce_row_features(target: TargetModel, row: PackedRow, row_index: int, cfg: RunConfig) -> RowFeatures | None:
    """The producer half: anchors of row ``row_index`` and the target features they need; None when
    the row has no valid anchor (nothing for the drafter to learn from it)."""
    block = cfg.drafter.block_size
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


def drafter_step(
    drafter: DFlashDrafter, feats: RowFeatures, cfg: RunConfig, *, train: bool = True, forward=None
) -> StepBatch:
    """The consumer half up to the loss: blocks of ``feats``' anchors, padded with weight-0 blocks to
    ``data.max_anchors`` (stable shapes from step to step), and the drafter's output over all of them.
    ``forward`` runs the drafter (default ``drafter``; a DDP wrapper of it on data-parallel ranks)."""
    spec, nb = drafter.spec, cfg.data.max_anchors
    b, n = spec.block_size, feats.anchors.numel()
    doc = doc_ids_from_positions(feats.position_ids)
    blocks = build_blocks(
        feats.input_ids,
        feats.position_ids,
        feats.loss_mask,
        feats.anchors,
        block_size=b,
        mask_token_id=spec.mask_token_id,
        gamma=cfg.loss.gamma,
        num_blocks=nb,
    )
    backend = cfg.drafter.attention_backend
    masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, backend)
    autocast = torch.autocast(feats.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.train.dtype == "bfloat16")
    with phase("drafter forward"), autocast, torch.set_grad_enabled(train):
        hidden = (forward or drafter)(
            blocks.input_ids, blocks.position_ids, feats.context, feats.position_ids, masks, backend
        )
    teacher = None
    if feats.teacher is not None:  # padding blocks have weight 0: the loss never reads their teacher rows
        teacher = feats.teacher.new_zeros(nb * b, feats.teacher.shape[-1])
        teacher[: n * b] = feats.teacher
    return StepBatch(
        hidden=hidden,
        teacher=teacher,
        labels=blocks.labels.reshape(-1),
        weights=blocks.weights.reshape(-1),
        slots=torch.arange(b, device=hidden.device).repeat(nb),
    )


def draft_loss(drafter: DFlashDrafter, batch: StepBatch, cfg: RunConfig, *, reference: bool = False):
    """``(loss, metrics)`` of one row's blocks: the fused loss, or the plain reference for benchmarks.
    The head and its logit transform are the drafter's (the target's, held by the drafter). Under
    ``train.dtype=bfloat16`` the head GEMMs run in bf16 like autocast's matmuls (an fp32 head is cast
    per step), while the loss's logits, softmax and gradient stay fp32."""
    head = drafter.lm_head_weight.detach()
    if cfg.train.dtype == "bfloat16":
        head = head.to(torch.bfloat16)
    hidden = batch.hidden.to(head.dtype)
    teacher = batch.teacher.to(head.dtype) if batch.teacher is not None else None
    kwargs = dict(
        kl_weight=cfg.loss.kl_weight,
        temperature=cfg.loss.temperature,
        cap_weight=cfg.loss.cap_weight,
        cap_temperature=cfg.loss.cap_temperature,
        label_source=cfg.loss.labels,
        **drafter.spec.logit_options,
    )
    with phase("loss"):
        if reference:
            return reference_draft_loss(hidden, teacher, head, batch.labels, batch.weights.to(head.dtype), **kwargs)
        return fused_draft_loss(
            hidden,
            teacher,
            head,
            batch.labels,
            batch.weights.to(head.dtype),
            slot_ids=batch.slots,
            num_slots=drafter.spec.block_size,
            chunk_size=cfg.loss.chunk_size,
            **kwargs,
        )
