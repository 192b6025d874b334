"""The training loop: producer (target features) -> consumer (drafter step, fused loss) -> optimizer.

One optimizer step takes ``grad_accum`` packed rows from the row stream. Row ``g`` of the stream
(its global row index) is row ``order(epoch)[g mod n]`` of the data set, where each epoch's order is
a permutation seeded by ``(train.seed, epoch)``; its anchors are seeded by ``(train.seed, g)``
(``step.row_generator``). So the data position of a run is one integer, ``rows_consumed``, and the
numbers of a run do not depend on how many processes produce rows. Per row (``step.py``):

    features = produce_row_features(target, row, g, cfg)    # [L, k*H], teacher [n*B, H] if needed
    batch    = drafter_step(drafter, features, cfg)         # [nb*B, H], nb = max_anchors (padded)
    loss     = draft_loss(drafter, batch, cfg)              # fused: never [positions x vocab]

then gradient clipping, AdamW (fp32 master weights, optional bf16 autocast) and a cosine schedule
with warmup. Checkpoints (``checkpoint.py``) hold everything a bit-identical resume needs.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig, write_resolved_config
from ..data.packing import PackedRow
from ..errors import UserError
from ..inference.acceptance import EvalInputError, acceptance_report
from ..model.drafter import DFlashDrafter, DrafterSpec, resolve_mask_token_id
from ..model.target import RowFeatures, TargetModel
from .checkpoint import find_resume_checkpoint, load_training_state, save_training_checkpoint, verify_checkpoint
from .step import draft_loss, drafter_step, phase, produce_row_features

EVAL_SEED = 1234  # anchors of the periodic evaluation: the same blocks at every evaluation
EVAL_BLOCKS_PER_ROW = 64


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


def build_drafter(cfg: RunConfig, target: TargetModel, tokenizer) -> DFlashDrafter:
    """A freshly initialized drafter for ``target`` (seeded by ``train.seed``), fp32 parameters, on the
    target's device."""
    mask_id = resolve_mask_token_id(tokenizer, cfg.drafter.mask_token_id, target.vocab_size)
    spec = DrafterSpec.from_target(
        target.config, cfg.drafter, num_features=len(target.layer_ids), mask_token_id=mask_id
    )
    torch.manual_seed(cfg.train.seed)
    # Built where the target is (its embedding and head are shared): on a GPU, initializing billions
    # of parameters there takes seconds where the CPU takes minutes.
    with torch.device(target.device):
        drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
        # Qwen-style init: normal(0, 0.02) for projections, ones for norms (the norms' default).
        for p in drafter.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
    return drafter.float()


def epoch_order(seed: int, epoch: int, num_rows: int) -> list[int]:
    """The data set's row order in ``epoch``: a permutation that depends on ``(seed, epoch)`` only."""
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + epoch * 0x27D4EB2F + 2) % (1 << 63))
    return torch.randperm(num_rows, generator=gen).tolist()


class RowStream:
    """Global row index ``g`` -> the packed row it names (epoch orders cached one at a time)."""

    def __init__(self, rows: list[PackedRow], seed: int):
        self.rows, self.seed = rows, seed
        self._epoch, self._order = -1, []

    def __getitem__(self, g: int) -> PackedRow:
        epoch, i = divmod(g, len(self.rows))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.seed, epoch, len(self.rows))
        return self.rows[self._order[i]]


@dataclass
class Counters:
    step: int = 0
    rows_consumed: int = 0  # global row index of the next row: the run's data position
    skipped_nonfinite: int = 0
    consecutive_nonfinite: int = 0
    rows_without_anchors: int = 0
    tokens: int = 0
    history: list = field(default_factory=list)


class Trainer:
    """Trains a drafter on packed rows; see the module docstring for one step.

    ``next_features`` (optional) replaces the in-process producer: a callable returning the next
    ``(RowFeatures | None, tokens)`` of the row stream, as a distributed run's drafter rank receives
    them; the target is then only used for the drafter's frozen embedding and head."""

    def __init__(
        self,
        cfg: RunConfig,
        target: TargetModel,
        tokenizer,
        train_rows: list[PackedRow],
        eval_rows: list[PackedRow],
        *,
        out_dir: Path,
        target_path: str | None,
        progress: bool = True,
        next_features: Callable[[int], tuple[RowFeatures | None, int]] | None = None,
    ):
        if not train_rows and next_features is None:
            raise UserError("no training rows: the data set produced no packed row")
        self.cfg, self.target, self.tokenizer = cfg, target, tokenizer
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.out_dir, self.target_path, self.progress = Path(out_dir), target_path, progress
        self.stream = RowStream(train_rows, cfg.train.seed) if train_rows else None
        self.next_features = next_features or self._produce
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        self.drafter = build_drafter(cfg, target, tokenizer).train()
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() > 1]
        no_decay = [p for p in params if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.train.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.c = Counters()
        self.stop_requested = None
        self.tb = None

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "counters": self.c.__dict__,
        }

    def save_checkpoint(self) -> Path:
        """``checkpoints/step-NNNNNNN/``: drafter, trainer state, run.yaml, checksums; atomic."""
        final = self.out_dir / "checkpoints" / f"step-{self.c.step:07d}"
        return save_training_checkpoint(
            final,
            self.drafter,
            self.state_dict(),
            self.cfg,
            target=self.target,
            target_path=self.target_path,
            step=self.c.step,
        )

    def load_checkpoint(self, path: Path) -> None:
        state = load_training_state(path, self.drafter)
        if "rows_consumed" not in state.get("counters", {}):
            raise UserError(
                f"checkpoint {path} was written by an older dflash-trainer (its data position is not a "
                "global row index) and cannot be resumed; its drafter still loads for eval and export"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.c = Counters(**state["counters"])

    # -- loop --------------------------------------------------------------------------------
    def _produce(self, g: int) -> tuple[RowFeatures | None, int]:
        row = self.stream[g]
        return produce_row_features(self.target, row, g, self.cfg), row.input_ids.numel()

    def _log(self, record: dict) -> None:
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def evaluate(self) -> dict:
        """Chain acceptance on the held-out rows (the same blocks every time), with the run's backend."""
        try:
            report = acceptance_report(
                self.target,
                self.drafter,
                self.eval_rows[: self.cfg.data.max_eval_rows],
                budgets=(),
                max_blocks_per_row=EVAL_BLOCKS_PER_ROW,
                seed=EVAL_SEED,
                attention_backend=self.cfg.drafter.attention_backend,
                decode_path=False,
            )
        except EvalInputError as exc:
            raise UserError(f"no evaluation block: {exc}") from None
        return {"tau": report["tau"], "blocks": report["blocks"], "slot_acceptance": report["slot_acceptance"]}

    def train_step(self) -> dict | None:
        """One optimizer step over ``grad_accum`` rows; None if the loss was not finite (step skipped)."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        totals, tokens, micro = {"loss": 0.0, "ce": 0.0, "kl": 0.0, "cap": 0.0, "accuracy": 0.0}, 0, 0
        finite = True
        while micro < cfg.train.grad_accum:
            feats, row_tokens = self.next_features(self.c.rows_consumed)
            self.c.rows_consumed += 1
            if feats is None:
                self.c.rows_without_anchors += 1
                continue
            batch = drafter_step(self.drafter, feats, cfg, train=True)
            loss, metrics = draft_loss(self.drafter, batch, cfg)
            if not torch.isfinite(loss):
                finite = False
            else:
                with phase("backward"):
                    (loss / cfg.train.grad_accum).backward()
            micro += 1
            tokens += row_tokens
            totals["loss"] += loss.item() / cfg.train.grad_accum
            for k in ("ce", "kl", "cap", "accuracy"):
                totals[k] += metrics[k].item() / cfg.train.grad_accum
        self.c.tokens += tokens
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.c.skipped_nonfinite += 1
            self.c.consecutive_nonfinite += 1
            if self.c.consecutive_nonfinite >= cfg.train.max_consecutive_nonfinite:
                raise UserError(
                    f"{self.c.consecutive_nonfinite} consecutive steps had a non-finite loss "
                    f"(step {self.c.step}); stopping. Lower train.lr or check the data."
                )
            return None
        self.c.consecutive_nonfinite = 0
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.train.grad_clip).item()
        with phase("optimizer"):
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
                raise UserError(
                    f"{self.out_dir} already holds checkpoints: continue with --resume auto, or start "
                    "over with --overwrite, or choose another output_dir"
                )
            shutil.rmtree(old_checkpoints)
        if not resume:
            (self.out_dir / "metrics.jsonl").unlink(missing_ok=True)
        write_resolved_config(cfg, self.out_dir)
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
        bar = tqdm(
            total=cfg.train.max_steps,
            initial=self.c.step,
            desc="train",
            unit="step",
            disable=not self.progress,
            mininterval=2,
        )
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
                    bar.set_postfix(
                        loss=f"{record.get('loss', float('nan')):.3f}",
                        tau=f"{last_eval.get('tau', float('nan')):.2f}",
                        tok_s=f"{rate:.0f}",
                        refresh=False,
                    )
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
