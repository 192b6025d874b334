"""The training loop: target features -> anchors and blocks -> drafter -> fused loss -> optimizer.

One step (shared/DESIGN.md section 4), for each of ``grad_accum`` packed rows:

    features = target.features(row)                       # [L, k*H], teacher [L, H] if needed
    blocks   = build_blocks(sample_anchors(row))          # [nb, B], nb = max_anchors (padded)
    hidden   = drafter(blocks, features)                  # [nb*B, H]
    loss     = fused_draft_loss(hidden, teacher[p-1], W)  # never [positions x vocab]

then gradient clipping, AdamW (fp32 master weights, optional bf16 autocast) and a cosine schedule
with warmup. Checkpoints hold everything a bit-identical resume needs (drafter, optimizer,
scheduler, RNG states, data position) and are written atomically with checksums.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .anchors import build_blocks, doc_ids_from_positions, sample_anchors
from .checkpoint import save_drafter
from .config import RunConfig, dump_config
from .data.packing import PackedRow
from .drafter import DFlashDrafter, DrafterSpec, resolve_mask_token_id
from .errors import UserError
from .loss import fused_draft_loss, head_logit_options

STATE_FILE = "trainer_state.pt"
CHECKSUMS = "checksums.json"


def lr_lambda(cfg: RunConfig):
    """Linear warmup over ``warmup_ratio * max_steps`` steps, then cosine decay to ``min_lr_ratio``."""
    total = cfg.train.max_steps
    warmup = int(cfg.train.warmup_ratio * total)
    floor = cfg.train.min_lr_ratio

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def build_drafter(cfg: RunConfig, target, tokenizer) -> DFlashDrafter:
    """A freshly initialized drafter for ``target`` (seeded by ``train.seed``), fp32 parameters."""
    mask_id = resolve_mask_token_id(tokenizer, cfg.drafter.mask_token_id, target.vocab_size)
    spec = DrafterSpec.from_target(target.config, cfg.drafter, num_features=len(target.layer_ids), mask_token_id=mask_id)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
    # Qwen-style init: normal(0, 0.02) for projections, ones for norms (the norms' default).
    for p in drafter.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    return drafter.float()


@dataclass
class StepBatch:
    """What one packed row contributes to the loss (all rows of its blocks, flattened)."""

    hidden: torch.Tensor  # [nb*B, H] drafter output
    teacher: torch.Tensor | None  # [nb*B, H] target final-normed hidden at anchor + k - 1
    labels: torch.Tensor  # [nb*B]
    weights: torch.Tensor  # [nb*B]
    slots: torch.Tensor  # [nb*B] slot index k


def row_forward(cfg: RunConfig, target, drafter: DFlashDrafter, row: PackedRow, generator: torch.Generator,
                *, max_anchors: int, train: bool) -> StepBatch | None:
    """Features, anchors, blocks and drafter output of one packed row; None if it has no valid anchor."""
    spec = drafter.spec
    need_teacher = cfg.loss.kl_weight > 0 or cfg.loss.labels == "teacher"
    doc = doc_ids_from_positions(row.position_ids)
    anchors = sample_anchors(row.loss_mask, doc, spec.block_size, max_anchors, generator)
    if anchors.numel() == 0:
        return None
    feats = target.features(row.input_ids, row.position_ids, need_teacher=need_teacher)
    # A fixed block count keeps shapes stable from step to step (padding blocks carry weight 0).
    blocks = build_blocks(row.input_ids, row.position_ids, row.loss_mask, anchors, block_size=spec.block_size,
                          mask_token_id=spec.mask_token_id, gamma=cfg.loss.gamma, num_blocks=max_anchors)
    masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, cfg.drafter.attention_backend)
    autocast = torch.autocast(row.input_ids.device.type, dtype=torch.bfloat16, enabled=cfg.train.dtype == "bfloat16")
    with autocast, torch.set_grad_enabled(train):
        hidden = drafter(blocks.input_ids, blocks.position_ids, feats.context, row.position_ids, masks,
                         cfg.drafter.attention_backend)
    teacher = feats.last_hidden[blocks.teacher_index.reshape(-1)] if feats.last_hidden is not None else None
    b = spec.block_size
    return StepBatch(hidden=hidden, teacher=teacher, labels=blocks.labels.reshape(-1),
                     weights=blocks.weights.reshape(-1), slots=torch.arange(b).repeat(max_anchors))


def loss_of(cfg: RunConfig, target, batch: StepBatch, *, reference: bool = False):
    """The draft loss of one row's blocks (the fused loss, or the plain reference for benchmarks)."""
    head = target.lm_head_weight.detach()
    hidden = batch.hidden.to(head.dtype)
    teacher = batch.teacher.to(head.dtype) if batch.teacher is not None else None
    kwargs = dict(kl_weight=cfg.loss.kl_weight, temperature=cfg.loss.temperature, cap_weight=cfg.loss.cap_weight,
                  cap_temperature=cfg.loss.cap_temperature, label_source=cfg.loss.labels,
                  **head_logit_options(target.config))
    if reference:
        from .loss import reference_draft_loss

        return reference_draft_loss(hidden, teacher, head, batch.labels, batch.weights.to(head.dtype), **kwargs)
    return fused_draft_loss(hidden, teacher, head, batch.labels, batch.weights.to(head.dtype), slot_ids=batch.slots,
                            num_slots=int(batch.slots.max()) + 1, chunk_size=cfg.loss.chunk_size, **kwargs)


@torch.no_grad()
def teacher_forced_acceptance(cfg: RunConfig, target, drafter: DFlashDrafter, rows: list[PackedRow],
                              max_blocks_per_row: int = 64, seed: int = 1234) -> dict:
    """Teacher-forced acceptance against the target's greedy tokens (DESIGN.md section 2).

    Per block: accepted = longest prefix of slots 1..B-1 whose drafter argmax equals the target's
    greedy token; tau = mean(accepted + 1). Also acceptance per slot, unconditional. Exact for
    greedy decoding because a block's output does not depend on the drafts inside it.
    """
    was_training = drafter.training
    drafter.eval()
    b = drafter.spec.block_size
    gen = torch.Generator().manual_seed(seed)
    accepted_all, slot_hits, blocks_seen = [], torch.zeros(b), 0
    head = target.lm_head_weight
    for row in rows:
        doc = doc_ids_from_positions(row.position_ids)
        anchors = sample_anchors(row.loss_mask, doc, b, max_blocks_per_row, gen)
        if anchors.numel() == 0:
            continue
        feats = target.features(row.input_ids, row.position_ids, need_teacher=True)
        blocks = build_blocks(row.input_ids, row.position_ids, row.loss_mask, anchors, block_size=b,
                              mask_token_id=drafter.spec.mask_token_id, gamma=cfg.loss.gamma)
        masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense")
        hidden = drafter(blocks.input_ids, blocks.position_ids, feats.context, row.position_ids, masks, "dense")
        n = anchors.numel()
        # Only the n*(B-1) selected rows are projected: never [L x V].
        draft = (hidden.view(n, b, -1)[:, 1:].to(head.dtype) @ head.T).argmax(-1)  # [n, B-1]
        greedy = (feats.last_hidden[blocks.teacher_index[:, 1:]].to(head.dtype) @ head.T).argmax(-1)  # [n, B-1]
        match = draft == greedy
        accepted_all.append(match.long().cumprod(1).sum(1))
        slot_hits[1:] += match.double().sum(0)
        blocks_seen += n
    drafter.train(was_training)
    if not blocks_seen:
        raise UserError("no evaluation block: the held-out rows have no valid anchor")
    accepted = torch.cat(accepted_all).double()
    return {"tau": (accepted + 1).mean().item(), "blocks": blocks_seen,
            "slot_acceptance": (slot_hits / blocks_seen).tolist()[1:]}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint folder is complete and every checksum matches, else the reason."""
    sums_file = path / CHECKSUMS
    if not sums_file.is_file():
        return "no checksums.json (incomplete write)"
    try:
        sums = json.loads(sums_file.read_text())
    except json.JSONDecodeError:
        return "checksums.json is not valid JSON"
    for name, digest in sums.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} does not match its checksum"
    return None


def find_resume_checkpoint(out_dir: Path) -> Path | None:
    """Newest checkpoint under ``out_dir/checkpoints`` that verifies; corrupted ones are skipped with a warning."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return None
    for path in sorted((p for p in root.iterdir() if p.name.startswith("step-")), reverse=True):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr, flush=True)
    return None


@dataclass
class Counters:
    step: int = 0
    epoch: int = 0
    row_index: int = 0  # position in this epoch's row order
    skipped_nonfinite: int = 0
    consecutive_nonfinite: int = 0
    rows_without_anchors: int = 0
    tokens: int = 0
    history: list = field(default_factory=list)


class Trainer:
    """Trains a drafter on packed rows; see the module docstring for one step."""

    def __init__(self, cfg: RunConfig, target, tokenizer, train_rows: list[PackedRow], eval_rows: list[PackedRow],
                 *, out_dir: Path, target_path: str | None, progress: bool = True):
        if not train_rows:
            raise UserError("no training rows: the data set produced no packed row")
        self.cfg, self.target, self.tokenizer = cfg, target, tokenizer
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.out_dir, self.target_path, self.progress = Path(out_dir), target_path, progress
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        self.drafter = build_drafter(cfg, target, tokenizer).train()
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() > 1]
        no_decay = [p for p in params if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.anchor_gen = torch.Generator().manual_seed(cfg.train.seed + 1)
        self.order_gen = torch.Generator().manual_seed(cfg.train.seed + 2)
        self.order = torch.randperm(len(train_rows), generator=self.order_gen).tolist()
        self.c = Counters()
        self.stop_requested = None

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "anchor_gen": self.anchor_gen.get_state(), "order_gen": self.order_gen.get_state(),
                "order": self.order, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "counters": self.c.__dict__}

    def save_checkpoint(self) -> Path:
        """``checkpoints/step-NNNNNNN/``: drafter, trainer state, run.yaml, checksums; atomic rename."""
        root = self.out_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.c.step:07d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        save_drafter(self.drafter, tmp / "drafter", target=self.target, target_path=self.target_path,
                     extra={"step": self.c.step})
        for name in os.listdir(tmp / "drafter"):
            os.replace(tmp / "drafter" / name, tmp / name)
        os.rmdir(tmp / "drafter")
        torch.save(self.state_dict(), tmp / STATE_FILE)
        (tmp / "run.yaml").write_text(dump_config(self.cfg))
        sums = {name: _sha256(tmp / name) for name in sorted(os.listdir(tmp))}
        (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        from .checkpoint import WEIGHTS

        self.drafter.load_state_dict(load_file(str(path / WEIGHTS)))
        state = torch.load(path / STATE_FILE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.anchor_gen.set_state(state["anchor_gen"])
        self.order_gen.set_state(state["order_gen"])
        self.order = state["order"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.c = Counters(**state["counters"])

    # -- loop --------------------------------------------------------------------------------
    def _next_row(self) -> PackedRow:
        if self.c.row_index >= len(self.order):
            self.c.epoch += 1
            self.c.row_index = 0
            self.order = torch.randperm(len(self.train_rows), generator=self.order_gen).tolist()
        row = self.train_rows[self.order[self.c.row_index]]
        self.c.row_index += 1
        return row

    def _log(self, record: dict) -> None:
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def evaluate(self) -> dict:
        return teacher_forced_acceptance(self.cfg, self.target, self.drafter, self.eval_rows[: self.cfg.data.max_eval_rows])

    def train_step(self) -> dict | None:
        """One optimizer step over ``grad_accum`` rows; None if the loss was not finite (step skipped)."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        totals, tokens, micro = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "cap": 0.0, "accuracy": 0.0}, 0, 0
        finite = True
        while micro < cfg.train.grad_accum:
            row = self._next_row()
            batch = row_forward(cfg, self.target, self.drafter, row, self.anchor_gen,
                                max_anchors=cfg.data.max_anchors, train=True)
            if batch is None:
                self.c.rows_without_anchors += 1
                continue
            loss, metrics = loss_of(cfg, self.target, batch)
            if not torch.isfinite(loss):
                finite = False
            else:
                (loss / cfg.train.grad_accum).backward()
            micro += 1
            tokens += row.input_ids.numel()
            totals["loss"] += loss.item() / cfg.train.grad_accum
            for k in ("ce", "kl", "cap", "accuracy"):
                totals[k] += metrics[k].item() / cfg.train.grad_accum
        self.c.tokens += tokens
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.c.skipped_nonfinite += 1
            self.c.consecutive_nonfinite += 1
            if self.c.consecutive_nonfinite >= cfg.train.max_consecutive_nonfinite:
                raise UserError(f"{self.c.consecutive_nonfinite} consecutive steps had a non-finite loss "
                                f"(step {self.c.step}); stopping. Lower train.lr or check the data.")
            return None
        self.c.consecutive_nonfinite = 0
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.train.grad_clip).item()
        self.optimizer.step()
        self.scheduler.step()
        return {**totals, "grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "tokens": tokens}

    def _on_signal(self, signum, _frame):
        self.stop_requested = signal.Signals(signum).name

    def fit(self, resume: str | None = None, overwrite: bool = False) -> dict:
        """Train to ``train.max_steps``; returns the final evaluation. ``resume``: "auto", a path or None.
        A fresh run refuses an output folder that already holds checkpoints unless ``overwrite``."""
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        old_checkpoints = self.out_dir / "checkpoints"
        if not resume and old_checkpoints.is_dir() and any(old_checkpoints.iterdir()):
            if not overwrite:
                raise UserError(f"{self.out_dir} already holds checkpoints: continue with --resume auto, or start "
                                "over with --overwrite, or choose another output_dir")
            shutil.rmtree(old_checkpoints)
        if not resume:
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
        (self.out_dir / "run.yaml").write_text(dump_config(cfg))
        if resume:
            path = find_resume_checkpoint(self.out_dir) if resume == "auto" else Path(resume)
            if path is not None:
                if resume != "auto" and verify_checkpoint(path):
                    raise UserError(f"checkpoint {path} cannot be resumed: {verify_checkpoint(path)}")
                self.load_checkpoint(path)
                print(f"resumed from {path} at step {self.c.step}", flush=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional
            self.tb = None
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = tqdm(total=cfg.train.max_steps, initial=self.c.step, desc="train", unit="step",
                   disable=not self.progress, mininterval=2)
        last_eval: dict = {}
        t_last, tok_last = time.time(), 0
        try:
            while self.c.step < cfg.train.max_steps:
                out = self.train_step()
                self.c.step += 1
                record = {"step": self.c.step, "skipped_nonfinite": self.c.skipped_nonfinite}
                if out is not None:
                    tok_last += out.pop("tokens")
                    record.update(out)
                if self.c.step % cfg.train.eval_every == 0 or self.c.step == cfg.train.max_steps:
                    last_eval = self.evaluate()
                    record.update({"eval_tau": last_eval["tau"], "eval_slot_acceptance": last_eval["slot_acceptance"]})
                self._log(record)
                now = time.time()
                if now - t_last > 2:
                    rate, t_last, tok_last = tok_last / (now - t_last), now, 0
                    bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}",
                                    tau=f"{last_eval.get('tau', float('nan')):.2f}", tok_s=f"{rate:.0f}", refresh=False)
                bar.update(1)
                if self.c.step % cfg.train.save_every == 0 or self.c.step == cfg.train.max_steps:
                    self.save_checkpoint()
                if self.stop_requested:
                    path = self.save_checkpoint()
                    print(f"\n{self.stop_requested}: saved {path}; resume with --resume auto", flush=True)
                    raise KeyboardInterrupt
        finally:
            bar.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.tb is not None:
                self.tb.close()
        return last_eval


__all__ = ["Trainer", "build_drafter", "find_resume_checkpoint", "loss_of", "row_forward",
           "teacher_forced_acceptance", "verify_checkpoint"]
