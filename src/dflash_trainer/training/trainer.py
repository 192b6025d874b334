"""The training loop: producer (target features) -> consumer (drafter step, fused loss) -> optimizer.

One optimizer step takes ``grad_accum`` packed rows from the row stream. Row ``g`` of the stream
(its global row index) is row ``order(epoch)[g mod n]`` of the data set, where each epoch's order is
a permutation seeded by ``(train.seed, epoch)``; its anchors are seeded by ``(train.seed, g)``
(``step.row_generator``). So the data position of a run is one integer, ``rows_consumed``, and the
numbers of a run do not depend on how many processes produce rows. Per row (``step.py``):

    features = produce_row_features(target, row, g, cfg)    # [L, k*H], teacher [n*B, H] if needed
    batch    = drafter_step(drafter, features, cfg)         # [nb*B, H], nb = max_anchors (padded)
    loss     = draft_loss(drafter, batch, cfg)              # fused: never [positions x vocab]

(under ``train.stage=on_policy`` the row's prompt is decoded by the target with the drafter, and the
loss is on those rounds' blocks instead: ``on_policy.py``), then gradient clipping and the optimizer
step (``optim.py``: AdamW or Muon + AdamW, fp32 master weights, optional bf16 autocast; a cosine,
linear or WSD schedule with warmup). Checkpoints (``checkpoint.py``) hold everything a bit-identical
resume needs. On a
drafter rank of a distributed run (``distributed.py``) the features arrive from the target ranks
instead of being produced here, the drafter may be wrapped in DDP, and only drafter rank 0 writes.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig, write_resolved_config
from ..data.blocks import valid_anchor_positions
from ..data.packing import PackedRow, doc_ids_from_positions
from ..errors import UserError
from ..inference.acceptance import EvalInputError, acceptance_report
from ..inference.regenerate import eos_ids
from ..io import atomic_write
from ..model.drafter import DFlashDrafter, DrafterSpec, resolve_mask_token_id
from ..model.target import TargetModel
from ..variants import make_drafter, variant_of
from .checkpoint import (
    config_changes,
    load_training_state,
    remove_dead_writes,
    resume_checkpoint,
    save_training_checkpoint,
)
from .distributed import StepPlan
from .on_policy import on_policy_row, produce_rollout_row
from .optim import Optimizers, muon_matrices, resolve_epochs
from .step import draft_loss, drafter_step, phase, produce_row_features, row_rng
from .trackers import STATE_FILE as TRACKER_STATE
from .trackers import Trackers, resolve_trackers, tracker_run_name
from .warm_start import warm_start

SFT_LOGGED = ("ce", "kl", "cap", "accuracy")  # a step's metrics beside its loss, per stage
ON_POLICY_LOGGED = ("forward_kl", "reverse_kl", "rollout_tau", "accepted_share")
EVAL_SEED = 1234  # anchors of the periodic evaluation: the same blocks at every evaluation
EVAL_BLOCKS_PER_ROW = 64


def build_drafter(cfg: RunConfig, target: TargetModel, tokenizer) -> DFlashDrafter:
    """A freshly initialized drafter for ``target`` (seeded by ``train.seed``), fp32 parameters, on the
    target's device; with ``drafter.init_from``, holding that folder's weights (``warm_start``)."""
    mask_id = resolve_mask_token_id(tokenizer, cfg.drafter.mask_token_id, target.vocab_size)
    spec = DrafterSpec.from_target(
        target.config, cfg.drafter, num_features=len(target.layer_ids), mask_token_id=mask_id
    )
    torch.manual_seed(cfg.train.seed)
    # Built where the target is (its embedding and head are shared): on a GPU, initializing billions
    # of parameters there takes seconds where the CPU takes minutes.
    with torch.device(target.device):
        drafter = make_drafter(spec, target.embed_tokens, target.lm_head_weight)
        # Qwen-style init: normal(0, 0.02) for projections, ones for norms (the norms' default).
        for p in drafter.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
    drafter = drafter.float()
    if cfg.drafter.init_from:
        warm_start(drafter, cfg.drafter.init_from, target)
        print(f"drafter: starting from the weights of {cfg.drafter.init_from}", flush=True)
    return drafter


def epoch_order(seed: int, epoch: int, num_rows: int) -> torch.Tensor:
    """The data set's row order in ``epoch`` ``[num_rows]``: a permutation that depends on ``(seed, epoch)`` only."""
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + epoch * 0x27D4EB2F + 2) % (1 << 63))
    return torch.randperm(num_rows, generator=gen)


def shard_window_order(seed: int, epoch: int, num_rows: int, rows_per_shard: int) -> torch.Tensor:
    """The row order of a feature cache read as a window (``data.feature_window``) ``[num_rows]``: its
    shards in order, the rows of each shuffled by ``(seed, epoch)``, so position ``g`` of an
    epoch is in shard ``g // rows_per_shard``: the epoch's shuffle of all rows, stably sorted by shard."""
    order = epoch_order(seed, epoch, num_rows)
    return order[torch.sort(order // rows_per_shard, stable=True).indices]


class RowStream:
    """Global row index ``g`` -> the packed row it names (epoch orders cached one at a time, as a
    tensor: 8 bytes per row, whatever the corpus). ``rows`` is a sequence: a list, or the memory-mapped
    ``storage.PackedRows`` that reads a row only when it is asked for. ``rows_per_shard``: the order of
    a feature cache read as a window (``shard_window_order``) instead of a shuffle of all rows."""

    def __init__(self, rows: Sequence[PackedRow], seed: int, rows_per_shard: int | None = None):
        self.rows, self.seed, self.rows_per_shard = rows, seed, rows_per_shard
        self._epoch, self._order = -1, torch.zeros(0, dtype=torch.long)

    def row_index(self, g: int) -> int:
        """The data set's row that global index ``g`` names."""
        epoch, i = divmod(g, len(self.rows))
        if epoch != self._epoch:
            n = len(self.rows)
            self._epoch = epoch
            if self.rows_per_shard:
                self._order = shard_window_order(self.seed, epoch, n, self.rows_per_shard)
            else:
                self._order = epoch_order(self.seed, epoch, n)
        return int(self._order[i])

    def __getitem__(self, g: int) -> PackedRow:
        return self.rows[self.row_index(g)]


def has_block(row: PackedRow, block_size: int) -> bool:
    """Whether ``row`` holds at least one valid anchor (a block of ``block_size`` tokens)."""
    doc = doc_ids_from_positions(row.position_ids)
    return valid_anchor_positions(row.loss_mask, doc, block_size).numel() > 0


def check_rows_have_blocks(train_rows: Sequence[PackedRow], eval_rows: Sequence[PackedRow], cfg: RunConfig) -> None:
    """Refuse, before the first step, data from which no block can be drawn: training would loop forever
    looking for an anchor, and evaluation would fail only after steps were spent."""
    b = cfg.drafter.block_span
    need = f"an anchor needs loss_mask 1 and {b - 1} more tokens of the same document within data.seq_len"
    # any() stops at the first row with a block: in a real data set that is the first row.
    if train_rows and not any(has_block(row, b) for row in train_rows):
        raise UserError(
            f"no training block: none of the {len(train_rows)} packed rows holds a block of {b} tokens ({need})"
        )
    scored = eval_rows[: cfg.data.max_eval_rows]
    if not any(has_block(row, b) for row in scored):
        raise UserError(
            f"no evaluation block: none of the {len(scored)} held-out rows scored holds a block of {b} tokens "
            f"({need}); set data.eval_files or data.eval_fraction"
        )


def truncate_metrics(path: Path, step: int) -> int:
    """Cut ``metrics.jsonl`` after the record of ``step`` (the checkpoint a run resumes from): the steps
    between that checkpoint and a kill are run again and must not be logged twice. A torn last line
    goes too. Returns how many lines were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            record_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            record_step = None
        if isinstance(record_step, int) and record_step <= step:
            kept.append(line + b"\n")
        else:
            dropped += 1
    if dropped:
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(b"".join(kept)))
    return dropped


@dataclass
class Counters:
    step: int = 0
    rows_consumed: int = 0  # global row index of the next row: the run's data position
    skipped_nonfinite: int = 0
    consecutive_nonfinite: int = 0
    rows_without_anchors: int = 0
    tokens: int = 0
    rollout_target_tokens: int = 0  # train.stage=on_policy: tokens the target ran for the rollouts,
    rollout_feature_tokens: int = 0  # and then over the rollouts' text for the drafter's context rows
    history: list = field(default_factory=list)


class Trainer:
    """Trains a drafter on packed rows; see the module docstring for one step.

    ``feed`` (a ``distributed.DrafterFeed``, or an ``offline.CachedFeed`` reading the feature cache) is
    where features come from instead of ``target``; ``group`` is the drafter ranks' process group (DDP
    when it has more than one)."""

    def __init__(
        self,
        cfg: RunConfig,
        target: TargetModel,
        tokenizer,
        train_rows: Sequence[PackedRow],
        eval_rows: Sequence[PackedRow],
        *,
        out_dir: Path,
        target_path: str | None,
        progress: bool = True,
        feed=None,
        group=None,
    ):
        if not train_rows:
            raise UserError("no training rows: the data set produced no packed row")
        cfg = resolve_epochs(cfg, len(train_rows))
        self.cfg, self.target, self.tokenizer = cfg, target, tokenizer
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.out_dir, self.target_path, self.progress = Path(out_dir), target_path, progress
        self.stream = RowStream(train_rows, cfg.train.seed)
        self.feed, self.group = feed, group
        self.device = feed.device if feed is not None else torch.device("cpu")
        self.data_parallel = group is not None and torch.distributed.get_world_size(group) > 1
        # A step's gradient is the mean over its grad_accum rows. DDP averages the ranks' gradients, so a
        # rank divides its rows' losses by the rows it holds (grad_accum / ranks), not by grad_accum:
        # otherwise the gradient is 1 / ranks too small, and gradient clipping (unlike AdamW's scale
        # invariance) makes the run leave the one-process run.
        ranks = torch.distributed.get_world_size(group) if self.data_parallel else 1
        self.loss_divisor = cfg.train.grad_accum / ranks
        self.is_writer = feed is None or feed.layout.drafter_index == 0
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        self.drafter = build_drafter(cfg, target, tokenizer).to(self.device).train()
        self.forward = self.drafter
        if self.data_parallel:
            self.forward = torch.nn.parallel.DistributedDataParallel(self.drafter, process_group=group)
        self.optimizers = Optimizers(list(self.drafter.parameters()), cfg, muon_matrices(self.drafter))
        self.c = Counters()
        self.plan = (
            feed.plan
            if feed is not None
            else StepPlan(self.stream, len(train_rows), cfg.drafter.block_span, cfg.train.grad_accum)
        )
        self.stop_requested = None
        self.trackers: Trackers | None = None
        self.eos = eos_ids(target.model, tokenizer) if cfg.train.stage == "on_policy" else []

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            **self.optimizers.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "counters": self.c.__dict__,
        }

    def save_checkpoint(self) -> Path:
        """``checkpoints/step-NNNNNNN/``: drafter, trainer state, run.yaml, checksums; atomic."""
        final = self.out_dir / "checkpoints" / f"step-{self.c.step:07d}"
        path = save_training_checkpoint(
            final,
            self.drafter,
            self.state_dict(),
            self.cfg,
            target=self.target,
            target_path=self.target_path,
            step=self.c.step,
        )
        if self.feed is not None:  # a resume restarts here: what lies before is no longer needed
            self.feed.checkpointed(self.c.rows_consumed)
        return path

    def load_checkpoint(self, path: Path) -> None:
        state = load_training_state(path, self.drafter)
        if "rows_consumed" not in state.get("counters", {}):
            raise UserError(
                f"checkpoint {path} was written by an older dflash-trainer (its data position is not a "
                "global row index) and cannot be resumed; its drafter still loads for eval and export"
            )
        self.optimizers.load_state_dict(state)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.c = Counters(**state["counters"])
        self.plan.next_g = self.c.rows_consumed

    # -- loop --------------------------------------------------------------------------------
    def _log(self, record: dict) -> None:
        try:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            raise UserError(
                f"cannot append to {self.out_dir / 'metrics.jsonl'}: {exc.strerror or exc}; "
                "free space and continue with --resume auto"
            ) from None
        if self.trackers is not None:
            self.trackers.log(record)

    def evaluate(self) -> dict:
        """Chain acceptance on the held-out rows (the same blocks every time), with the run's backend."""
        target = self.feed.eval_features() if self.feed is not None else self.target
        try:
            report = acceptance_report(
                target,
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

    def _my_rows(self, rows: list[int]) -> list[int]:
        """This rank's share of a step's rows: all of them in one process, a contiguous slice per drafter rank."""
        if self.feed is None:
            return rows
        per = len(rows) // self.feed.layout.drafter_ranks
        i = self.feed.layout.drafter_index
        return rows[i * per : (i + 1) * per]

    def train_step(self) -> dict | None:
        """One optimizer step over ``grad_accum`` rows; None if the loss was not finite (step skipped)."""
        cfg = self.cfg
        self.zero_grad()
        rows, skipped = self.plan.step()
        self.c.rows_without_anchors += skipped
        self.c.rows_consumed = self.plan.next_g
        mine = self._my_rows(rows)
        # [loss, *logged (4), tokens, finite, *the variant's logged metrics]: summed over this rank's rows,
        # then over drafter ranks
        on_policy = cfg.train.stage == "on_policy"
        logged = ON_POLICY_LOGGED if on_policy else SFT_LOGGED
        extra = variant_of(self.drafter.spec).logged_metrics
        totals = torch.zeros(7 + len(extra), dtype=torch.float64)
        totals[6] = 1.0
        if on_policy and self.feed is not None:  # the target ranks roll out with this step's weights
            self.feed.share_drafter(self.drafter)
        for j, g in enumerate(mine):
            if on_policy:  # the drafter's own rollout of the row's prompt (its rounds are the blocks)
                row = self._rollout(g)
                if row is None:
                    continue
                n_tokens = int(row.features.loss_mask.sum())
            else:
                feats = (
                    self.feed.take(g)
                    if self.feed is not None
                    else produce_row_features(self.target, self.stream[g], g, cfg)
                )
                n_tokens = feats.input_ids.numel()
            sync = nullcontext() if not self.data_parallel or j == len(mine) - 1 else self.forward.no_sync()
            with sync:
                if on_policy:
                    with row_rng(cfg.train.seed, g, self.device):
                        loss, metrics = on_policy_row(self.drafter, row, cfg, forward=self.forward)
                else:
                    with row_rng(cfg.train.seed, g, feats.context.device):
                        batch = drafter_step(self.drafter, feats, cfg, train=True, forward=self.forward)
                    loss, metrics = draft_loss(self.drafter, batch, cfg)
                finite = bool(torch.isfinite(loss))
                # a non-finite row still runs backward on data-parallel ranks (DDP's all-reduce needs every
                # rank); its gradients are thrown away below
                if finite or self.data_parallel:
                    with phase("backward"):
                        (torch.nan_to_num(loss) / self.loss_divisor).backward()
            totals[6] = min(totals[6].item(), float(finite))
            totals[0] += loss.item() / cfg.train.grad_accum
            for k, name in enumerate(logged, start=1):
                totals[k] += metrics[name].item() / cfg.train.grad_accum
            for k, name in enumerate(extra, start=7):
                totals[k] += float(metrics[name]) / cfg.train.grad_accum
            totals[5] += n_tokens
        if self.data_parallel:
            finite_flag = totals[6].clone()
            torch.distributed.all_reduce(totals, group=self.group)
            torch.distributed.all_reduce(finite_flag, op=torch.distributed.ReduceOp.MIN, group=self.group)
            totals[6] = finite_flag
        tokens = int(totals[5])
        self.c.tokens += tokens
        finite = bool(totals[6] >= 1)
        grad_norm = float("nan")
        if finite:
            # A finite loss can still give an inf/NaN gradient; stepping on it would make every weight NaN.
            # After DDP's all-reduce every drafter rank holds the same gradients, so they agree here.
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.train.grad_clip).item()
            finite = math.isfinite(grad_norm)
        if not finite:
            self.zero_grad()
            self.c.skipped_nonfinite += 1
            self.c.consecutive_nonfinite += 1
            if self.c.consecutive_nonfinite >= cfg.train.max_consecutive_nonfinite:
                raise UserError(
                    f"{self.c.consecutive_nonfinite} consecutive steps had a non-finite loss or gradient "
                    f"(step {self.c.step}); stopping. Lower train.lr or check the data."
                )
            return None
        self.c.consecutive_nonfinite = 0
        self.optimizer_step()
        out = {name: totals[k].item() for k, name in enumerate(("loss", *logged))}
        if on_policy:
            out["rollout_target_tokens"] = self.c.rollout_target_tokens
        out.update({name: totals[k].item() for k, name in enumerate(extra, start=7)})
        return {**out, "grad_norm": grad_norm, "lr": self.optimizers.lr, "tokens": tokens}

    def _rollout(self, g: int):
        """Row ``g``'s on-policy training row (``on_policy.produce_rollout_row``, or from a target rank),
        or None (counted with the rows without anchors) when the row has no prompt or decoding verified
        no round."""
        if self.feed is not None:
            row = self.feed.take_rollout(g)
        else:
            row = produce_rollout_row(self.target, self.drafter, self.stream[g], self.eos, self.cfg, g)
        if row is None:
            self.c.rows_without_anchors += 1
        else:
            self.c.rollout_target_tokens += row.target_tokens
            self.c.rollout_feature_tokens += row.features.input_ids.numel()  # the pass over the rollout's text
        return row

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()

    def optimizer_step(self) -> None:
        """Every optimizer's step on the gradients the rows left, then the schedule's step."""
        with phase("optimizer"):
            self.optimizers.step()

    @property
    def epoch(self) -> float:
        """Passes over the training rows so far (rows consumed / rows)."""
        return self.c.rows_consumed / len(self.train_rows)

    def _on_signal(self, signum, _frame):
        self.stop_requested = signal.Signals(signum).name

    @staticmethod
    def prepare_output(
        cfg: RunConfig, out_dir: Path, resume: str | None, overwrite: bool, train_rows: list, eval_rows: list
    ) -> Path | None:
        """Prepare ``out_dir`` (the writer's job) and return the checkpoint to resume from, if any.
        A fresh run refuses an output folder that already holds checkpoints unless ``overwrite``."""
        check_rows_have_blocks(train_rows, eval_rows, cfg)
        write_resolved_config(cfg, out_dir)  # also: a clear error for an unusable output_dir
        for dead in remove_dead_writes(out_dir):
            print(f"removed {dead}: the temporary folder of a checkpoint write that did not finish", flush=True)
        path = resume_checkpoint(out_dir, resume, overwrite)
        old_checkpoints = out_dir / "checkpoints"
        if path is None and old_checkpoints.is_dir() and any(old_checkpoints.iterdir()):
            if not overwrite:
                raise UserError(
                    f"{out_dir} already holds checkpoints: continue with --resume auto, or start "
                    "over with --overwrite, or choose another output_dir"
                )
            shutil.rmtree(old_checkpoints)
        if path is None:
            (out_dir / "metrics.jsonl").unlink(missing_ok=True)
            (out_dir / TRACKER_STATE).unlink(missing_ok=True)  # a fresh run starts new tracker runs
            return None
        changes = config_changes(path, cfg)
        if changes:
            raise UserError(
                f"checkpoint {path} was trained with other settings that change what a step computes: "
                + "; ".join(changes)
                + ". Resume with its settings (its run.yaml), or start over with --overwrite"
            )
        return path

    def resume_from(self, path: Path) -> None:
        """Load a checkpoint ``prepare_output`` picked; the writer cuts metrics.jsonl to its step (the steps
        between that checkpoint and a kill run again and must not be logged twice)."""
        self.load_checkpoint(path)
        if self.is_writer:
            truncate_metrics(self.out_dir / "metrics.jsonl", self.c.step)
            print(f"resumed from {path} at step {self.c.step}", flush=True)

    def fit(self, resume: str | None = None, overwrite: bool = False) -> dict:
        """Train to ``train.max_steps`` in this process; returns the final evaluation. ``resume``: "auto",
        a path or None."""
        path = self.prepare_output(self.cfg, self.out_dir, resume, overwrite, self.train_rows, self.eval_rows)
        if path is not None:
            self.resume_from(path)
        return self.run()

    def _stop_agreed(self) -> str | None:
        """The stop request, agreed by every drafter rank (they must stop after the same step)."""
        if not self.data_parallel:
            return self.stop_requested
        flag = torch.tensor([1.0 if self.stop_requested else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return (self.stop_requested or "SIGTERM") if flag.item() else None

    def run(self) -> dict:
        """The loop from the current step to ``train.max_steps`` (state already loaded or fresh)."""
        cfg = self.cfg
        if self.is_writer:  # a fresh run is at step 0; a resumed one continues its tracker runs
            self.trackers = Trackers(
                resolve_trackers(cfg.train.trackers),
                self.out_dir,
                tracker_run_name(cfg),
                cfg.train.tracker_project,
                cfg.model_dump(mode="json"),
                resume_step=self.c.step or None,
            )
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = tqdm(
            total=cfg.train.max_steps,
            initial=self.c.step,
            desc="train",
            unit="step",
            disable=not (self.progress and self.is_writer),
            mininterval=2,
        )
        last_eval: dict = {}
        t_start = t_last = time.time()
        tok_last = 0
        try:
            while self.c.step < cfg.train.max_steps:
                out = self.train_step()
                self.c.step += 1
                if self.feed is not None:
                    self.feed.end_step()
                record = {
                    "step": self.c.step,
                    "skipped_nonfinite": self.c.skipped_nonfinite,
                    "epoch": round(self.epoch, 6),
                    "elapsed_s": time.time() - t_start,  # this process's wall time since the loop began
                }
                if out is not None:
                    tok_last += out["tokens"]
                    record.update(out)
                if self.feed is not None:
                    record.update(self.feed.metrics(time.time() - t_start))
                if self.c.step % cfg.train.eval_every == 0 or self.c.step == cfg.train.max_steps:
                    if self.is_writer:
                        last_eval = self.evaluate()
                        record.update(
                            {"eval_tau": last_eval["tau"], "eval_slot_acceptance": last_eval["slot_acceptance"]}
                        )
                if self.is_writer:
                    self._log(record)
                now = time.time()
                if now - t_last > 2:
                    rate, t_last, tok_last = tok_last / (now - t_last), now, 0
                    extra = self.feed.postfix(record) if self.feed is not None else {}
                    bar.set_postfix(
                        loss=f"{record.get('loss', float('nan')):.3f}",
                        tau=f"{last_eval.get('tau', float('nan')):.2f}",
                        tok_s=f"{rate:.0f}",
                        epoch=f"{self.epoch:.2f}" + (f"/{cfg.train.epochs:g}" if cfg.train.epochs else ""),
                        **extra,
                        refresh=False,
                    )
                bar.update(1)
                if self.is_writer and (self.c.step % cfg.train.save_every == 0 or self.c.step == cfg.train.max_steps):
                    self.save_checkpoint()
                stop = self._stop_agreed()
                if stop:
                    if self.is_writer:
                        path = self.save_checkpoint()
                        print(f"\n{stop}: saved {path}; resume with --resume auto", flush=True)
                    # under torchrun a SIGTERM often means another rank failed: name it when we saw it
                    if self.feed is not None and self.feed.peer_error() is not None:
                        raise self.feed.peer_error()
                    raise KeyboardInterrupt
        finally:
            bar.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.trackers is not None:
                self.trackers.close()
                self.trackers = None
        return last_eval
