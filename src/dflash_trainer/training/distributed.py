"""Disaggregated training on torch.distributed: target ranks feed drafter ranks (shared/DESIGN.md 4b).

    ranks [0, T)     target ranks: the frozen target body only; each produces the RowFeatures of its
                     share of the row stream and sends them to the drafter rank that trains on them
    ranks [T, T+D)   drafter ranks: receive, run the drafter, the fused loss (with the target's head,
                     held here), backward and AdamW; D > 1 are data-parallel (DDP on their own group)

Who does what is a pure function of the step (``StepPlan``): step s trains on the next
``grad_accum`` usable rows of the global row stream (rows with at least one valid anchor; every rank
can tell, without the target); micro-batch i of the step is micro ``m = s * G + i``, produced by
target rank ``m % T`` and trained on by drafter rank ``T + i // (G / D)``. Anchors are seeded by the
row's global index, the drafter's feature noise by the same, so the numbers of a run do not depend
on T or D (one process is the special case T = 0, D = 1).

On each (target, drafter) channel the messages follow one fixed order, known to both ends: per
micro-batch a small int64 header, then the payload (ids/positions/mask/anchors, context, teacher);
after an evaluation step, target rank 0 also sends the held-out rows' features to drafter rank T.
Both ends move messages on a background thread with blocking sends and receives in exactly that
order (NCCL matches point-to-point messages by order, not by tag), through queues of at most
``topology.prefetch`` rows: the next row's transfer overlaps this row's compute, a fast drafter
waits only for data, and a slow one never lets buffers grow. Every wait has a deadline
(``topology.timeout_s``; the process group's own timeout is the same): a dead or hung peer becomes
one line that names its rank and role.

The on-policy stage (``train.stage=on_policy``, one drafter rank): a target rank holds the whole target
and a copy of the drafter, decodes its rows' prompts with it (``on_policy.produce_rollout_row``) and
sends each rollout's training row (kind 2: the features, then the slots' weights and accepted flags,
the rollout's tau and target tokens; kind 3: a row without a rollout). Before every step the drafter
rank broadcasts its weights to the target ranks (``broadcast_drafter``), so that step's rollouts draft
with exactly the weights a single process would: the numbers do not depend on T.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..data.blocks import valid_anchor_positions
from ..data.packing import PackedRow, doc_ids_from_positions
from ..errors import UserError
from ..model.target import RowFeatures, TargetFeatures
from .on_policy import RolloutRow, produce_rollout_row

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEADER = 10  # int64 fields: kind, m, g, n, L, kH, H, has_teacher, dtype code, busy microseconds
ROW, EVAL_ROW, ROLLOUT_ROW, NO_ROLLOUT = 0, 1, 2, 3  # message kinds


class PeerError(UserError):
    """A peer rank died, hung, or closed its connection."""


# -- launch ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """This process's place in a launch of ``world`` processes: T target ranks, then D drafter ranks."""

    rank: int
    world: int
    target_ranks: int

    @property
    def drafter_ranks(self) -> int:
        return self.world - self.target_ranks

    @property
    def is_target(self) -> bool:
        return self.rank < self.target_ranks

    @property
    def drafter_index(self) -> int:
        return self.rank - self.target_ranks

    def role(self, rank: int) -> str:
        return "target" if rank < self.target_ranks else "drafter"


def launched_world() -> int:
    """Processes of this launch (torchrun sets WORLD_SIZE); 1 without a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_launch(cfg: RunConfig, world: int) -> None:
    """One line when the launch and ``topology`` disagree; the same check on every rank, before any
    model is loaded."""
    t, d = cfg.topology.target_ranks, cfg.topology.drafter_ranks
    if cfg.data.features:
        if t:
            raise UserError(
                f"data.features trains from cached features, without a target: topology.target_ranks must be 0, got {t}"
            )
        if world != d:
            raise UserError(
                f"launched with {world} process{'es' if world > 1 else ''} but topology.drafter_ranks is {d}: "
                + (
                    f"launch with `torchrun --nproc-per-node {d} --no-python dflash-train train ...`"
                    if world == 1
                    else f"set topology.drafter_ranks={world}"
                )
            )
        if cfg.train.grad_accum % d:
            raise UserError(
                f"train.grad_accum {cfg.train.grad_accum} must be a multiple of topology.drafter_ranks {d} "
                "(each drafter rank takes an equal share of a step's rows)"
            )
        return
    if t == 0:
        if world > 1:
            raise UserError(
                f"launched with {world} processes but topology.target_ranks is 0 (one process runs the target and "
                f"the drafter): set topology.target_ranks (e.g. {world - d}) or run without torchrun"
            )
        if d != 1:
            raise UserError("topology.drafter_ranks > 1 needs topology.target_ranks >= 1 and a torchrun launch")
        return
    if world == 1:
        raise UserError(
            f"topology.target_ranks is {t}: launch with `torchrun --nproc-per-node {t + d} --no-python dflash-train "
            "train ...` (or set topology.target_ranks=0 to run in one process)"
        )
    if world != t + d:
        raise UserError(
            f"world size {world} does not match topology.target_ranks {t} + topology.drafter_ranks {d} = {t + d}"
        )
    if cfg.train.grad_accum % d:
        raise UserError(
            f"train.grad_accum {cfg.train.grad_accum} must be a multiple of topology.drafter_ranks {d} "
            "(each drafter rank takes an equal share of a step's rows)"
        )


def init(cfg: RunConfig) -> tuple[Layout, torch.device, object]:
    """Join the process group torchrun set up (NCCL on CUDA, gloo on CPU); ``(layout, device, drafter group)``."""
    from datetime import timedelta

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.topology.timeout_s))
    layout = Layout(dist.get_rank(), dist.get_world_size(), cfg.topology.target_ranks)
    # every rank must take part in creating a group, members or not
    group = dist.new_group(list(range(layout.target_ranks, layout.world)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return layout, device, group


def on_rank0(timeout_s: float):
    """``share(fn)`` for ``setup.prepare``: global rank 0 runs ``fn()`` (prepares the data, however long
    that takes up to ``timeout_s``) while every other rank waits on a gloo barrier with that deadline;
    all return rank 0's result, or all raise its one-line ``UserError``. Every rank must call it."""
    from datetime import timedelta

    def share(fn):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        box = [None]
        if dist.get_rank() == 0:
            try:
                box = [("ok", fn())]
            except UserError as exc:
                box = [("error", str(exc))]
        dist.broadcast_object_list(box, src=0, group=group)
        dist.destroy_process_group(group)
        kind, value = box[0]
        if kind == "error":
            raise UserError(value)
        return value

    return share


def weights_group(cfg: RunConfig, layout: Layout):
    """The on-policy stage's group: the target ranks and the (one) drafter rank, which broadcasts its
    weights to them before every step; None for SFT. Every rank must call it."""
    from datetime import timedelta

    if cfg.train.stage != "on_policy":
        return None
    ranks = list(range(layout.target_ranks + 1))
    return dist.new_group(ranks, timeout=timedelta(seconds=cfg.topology.timeout_s))


def broadcast_drafter(drafter, group, layout: Layout, timeout_s: float) -> None:
    """The drafter's parameters, one flat buffer, from the drafter rank to the target ranks of ``group``
    (sent where this is the drafter rank, received and loaded on a target rank)."""
    params = list(drafter.parameters())
    flat = torch.nn.utils.parameters_to_vector(params).detach()
    src = layout.target_ranks
    try:
        dist.broadcast(flat, src=src, group=group)
    except RuntimeError as exc:
        peer = src if layout.is_target else 0
        raise _peer_error(exc, peer, layout, "share the drafter's weights", timeout_s) from None
    if layout.is_target:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat, params)


# -- who does what --------------------------------------------------------------------------------


def usable(row: PackedRow, block_size: int) -> bool:
    """The row has at least one valid anchor (else no rank spends anything on it)."""
    doc = doc_ids_from_positions(row.position_ids)
    return valid_anchor_positions(row.loss_mask, doc, block_size).numel() > 0


class StepPlan:
    """The global row indices of each step's micro-batches, identical on every rank.

    ``stream[g]`` is the packed row with global index g; ``start`` the run's ``rows_consumed``."""

    def __init__(self, stream, num_rows: int, block_size: int, grad_accum: int, start: int = 0):
        self.stream, self.num_rows, self.block_size, self.grad_accum = stream, num_rows, block_size, grad_accum
        self.next_g = start
        # By data-set row: a row's usability never changes. int8, -1 = not looked at yet: one byte per row.
        self._usable = torch.full((num_rows,), -1, dtype=torch.int8)

    def next_usable(self) -> tuple[int, int]:
        """``(g, skipped)``: the next usable global row index and how many unusable rows were passed."""
        skipped = 0
        while True:
            g = self.next_g
            self.next_g += 1
            key = self.stream.row_index(g)
            if self._usable[key] < 0:
                self._usable[key] = int(usable(self.stream.rows[key], self.block_size))
            if self._usable[key]:
                return g, skipped
            skipped += 1
            if skipped >= self.num_rows:
                raise UserError(
                    f"no packed row has a valid anchor (a position with loss_mask 1 and {self.block_size - 1} more "
                    "tokens of its document): the data cannot train a drafter of this block size"
                )

    def step(self) -> tuple[list[int], int]:
        """The next step's ``grad_accum`` global row indices and the unusable rows skipped before them."""
        rows, skipped = [], 0
        for _ in range(self.grad_accum):
            g, s = self.next_usable()
            rows.append(g)
            skipped += s
        return rows, skipped


def is_eval_step(cfg: RunConfig, step: int) -> bool:
    """``step`` counts from 1 (after the optimizer step), as the trainer's log does."""
    return step % cfg.train.eval_every == 0 or step == cfg.train.max_steps


# -- the wire -------------------------------------------------------------------------------------


def pack(kind: int, m: int, g: int, feats: RowFeatures, busy_us: int) -> list[torch.Tensor]:
    """``[header, ints, context(, teacher)]``: what one micro-batch puts on the wire."""
    n, length = feats.anchors.numel(), feats.input_ids.numel()
    kh, h = feats.context.shape[-1], (feats.teacher.shape[-1] if feats.teacher is not None else 0)
    header = torch.tensor(
        [kind, m, g, n, length, kh, h, feats.teacher is not None, DTYPES.index(feats.context.dtype), busy_us],
        dtype=torch.int64,
        device=feats.context.device,
    )
    ints = torch.cat([feats.input_ids, feats.position_ids, feats.loss_mask, feats.anchors]).to(torch.int64)
    parts = [header, ints, feats.context.contiguous()]
    if feats.teacher is not None:
        parts.append(feats.teacher.contiguous())
    return parts


def pack_rollout(m: int, g: int, row: RolloutRow | None, busy_us: int, device: torch.device) -> list[torch.Tensor]:
    """An on-policy micro-batch on the wire: ``pack``'s parts and ``[weights, accepted, tau, target tokens]``
    (float64, ``2 n B + 2``), or the header alone for a row without a rollout."""
    if row is None:
        return [torch.tensor([NO_ROLLOUT, m, g, 0, 0, 0, 0, 0, 0, busy_us], dtype=torch.int64, device=device)]
    extras = torch.cat(
        [
            row.weights.double(),
            row.accepted.double(),
            torch.tensor([row.tau, row.target_tokens], dtype=torch.float64, device=row.weights.device),
        ]
    )
    return [*pack(ROLLOUT_ROW, m, g, row.features, busy_us), extras]


def payload_buffers(header: torch.Tensor, block_size: int, device: torch.device) -> list[torch.Tensor]:
    kind, _, _, n, length, kh, h, has_teacher, code, _ = header.tolist()
    if kind == NO_ROLLOUT:
        return []
    dtype = DTYPES[code]
    bufs = [
        torch.empty(3 * length + n, dtype=torch.int64, device=device),
        torch.empty(length, kh, dtype=dtype, device=device),
    ]
    if has_teacher:
        rows = n * block_size if n else length  # an evaluation row carries every final hidden state
        bufs.append(torch.empty(rows, h, dtype=dtype, device=device))
    if kind == ROLLOUT_ROW:
        bufs.append(torch.empty(2 * n * block_size + 2, dtype=torch.float64, device=device))
    return bufs


def unpack(header: torch.Tensor, bufs: list[torch.Tensor]) -> RowFeatures | RolloutRow | None:
    """A row's features (kinds 0, 1), a rollout's training row (2) or None (3: no rollout)."""
    kind, n, length = int(header[0]), int(header[3]), int(header[4])
    if kind == NO_ROLLOUT:
        return None
    ints = bufs[0]
    features = RowFeatures(
        input_ids=ints[:length],
        position_ids=ints[length : 2 * length],
        loss_mask=ints[2 * length : 3 * length],
        anchors=ints[3 * length : 3 * length + n],
        context=bufs[1],
        teacher=bufs[2] if len(bufs) > 2 else None,
    )
    if kind != ROLLOUT_ROW:
        return features
    extras = bufs[3]
    slots = (extras.numel() - 2) // 2  # n * B
    weights, accepted = extras[:slots].float(), extras[slots : 2 * slots].bool()
    return RolloutRow(features, accepted, weights, float(extras[-2]), int(extras[-1]))


def _peer_error(exc: BaseException, peer: int, layout: Layout, what: str, timeout_s: float) -> PeerError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "timed out" in first.lower():  # the process group's own deadline (the same topology.timeout_s)
        return _timeout_error(peer, layout, what, timeout_s)
    return PeerError(
        f"rank {peer} ({layout.role(peer)} rank) is gone or hung: rank {layout.rank} could not {what} ({first[:160]})"
    )


def _timeout_error(peer: int, layout: Layout, what: str, timeout_s: float) -> PeerError:
    return PeerError(
        f"rank {peer} ({layout.role(peer)} rank) sent or received nothing for {timeout_s:g} s while rank "
        f"{layout.rank} ({layout.role(layout.rank)}) waited to {what}: it is hung or dead "
        "(topology.timeout_s sets the limit)"
    )


class Sender:
    """A target rank's outgoing micro-batches. A background thread sends them (blocking sends, in
    order); the producer may run at most ``prefetch`` rows ahead of what has left."""

    def __init__(self, layout: Layout, prefetch: int, timeout_s: float):
        self.layout, self.timeout_s = layout, timeout_s
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.error: PeerError | None = None
        self.current = -1  # the destination being sent to
        self.thread = threading.Thread(target=self._loop, daemon=True, name="dflash-sender")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            dst, parts = item
            self.current = dst
            try:
                for part in parts:
                    dist.send(part, dst)
            except RuntimeError as exc:
                self.error = _peer_error(exc, dst, self.layout, "send a row", self.timeout_s)
                return
            finally:
                self.queue.task_done()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def send(self, dst: int, parts: list[torch.Tensor]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._check()
            try:
                self.queue.put((dst, parts), timeout=0.05)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise _timeout_error(self.current, self.layout, "send a row", self.timeout_s) from None

    def flush(self) -> None:
        """Wait until everything queued has been sent."""
        deadline = time.monotonic() + self.timeout_s
        while self.queue.unfinished_tasks:
            self._check()
            if time.monotonic() > deadline:
                raise _timeout_error(self.current, self.layout, "send a row", self.timeout_s)
            time.sleep(0.01)
        self._check()
        self.queue.put(None)


class Receiver:
    """A drafter rank's incoming messages, received by a background thread in the order the plan
    fixes (``expect(src)`` announces the next message, on channel ``src``) into a queue of at most
    ``prefetch`` messages: the next rows arrive while this one trains, and no buffer grows unbounded."""

    def __init__(self, layout: Layout, block_size: int, device: torch.device, prefetch: int, timeout_s: float):
        self.layout, self.block_size, self.device, self.timeout_s = layout, block_size, device, timeout_s
        self.announced: queue.Queue = queue.Queue()
        self.ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self.error: PeerError | None = None
        self.current = -1  # the source being received from
        self.wait_s = 0.0
        self.bytes = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name="dflash-receiver")
        self.thread.start()

    def expect(self, src: int) -> None:
        self.announced.put(src)

    def _loop(self) -> None:
        while True:
            src = self.announced.get()
            self.current = src
            try:
                header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
                dist.recv(header, src)
                bufs = payload_buffers(header, self.block_size, self.device)
                for b in bufs:
                    dist.recv(b, src)
            except RuntimeError as exc:
                self.error = _peer_error(exc, src, self.layout, "receive a row", self.timeout_s)
                return
            self.bytes += HEADER * 8 + sum(b.numel() * b.element_size() for b in bufs)
            self.ready.put((src, header, unpack(header, bufs)))

    def take(self) -> tuple[int, torch.Tensor, RowFeatures]:
        """The oldest announced message: ``(source rank, header, features)``; waits at most ``timeout_s``."""
        t0 = time.monotonic()
        while True:
            try:
                item = self.ready.get(timeout=0.05)
                break
            except queue.Empty:
                if self.error is not None:
                    raise self.error from None
                if time.monotonic() - t0 > self.timeout_s:
                    raise _timeout_error(self.current, self.layout, "receive a row", self.timeout_s) from None
        self.wait_s += time.monotonic() - t0
        return item


# -- the target rank's loop -----------------------------------------------------------------------


def eval_feature_rows(rows: list[PackedRow], cfg: RunConfig) -> list[int]:
    """Indices of the held-out rows the evaluation runs the target on (those with a valid anchor)."""
    return [i for i, row in enumerate(rows[: cfg.data.max_eval_rows]) if usable(row, cfg.drafter.block_span)]


def _eval_message(row: PackedRow, feats: TargetFeatures) -> RowFeatures:
    empty = torch.zeros(0, dtype=torch.long, device=row.input_ids.device)
    return RowFeatures(row.input_ids, row.position_ids, row.loss_mask, empty, feats.context, feats.last_hidden)


def run_target_rank(
    cfg: RunConfig,
    layout: Layout,
    target,
    stream,
    num_rows: int,
    eval_rows: list[PackedRow],
    *,
    start_step: int,
    rows_consumed: int,
    device: torch.device,
    rollouts=None,
    log=print,
) -> None:
    """Produce and send this rank's micro-batches from ``start_step`` to ``train.max_steps``.
    ``rollouts``: ``(drafter, eos ids, weights group)`` for the on-policy stage (its rows are rollouts
    drafted with the weights the drafter rank broadcasts before each step)."""
    from .step import produce_row_features

    stop = {"flag": None}

    def on_signal(signum, _frame):
        stop["flag"] = signal.Signals(signum).name  # keep serving: the drafter finishes its step first

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    g_accum, t_ranks, d_ranks = cfg.train.grad_accum, layout.target_ranks, layout.drafter_ranks
    plan = StepPlan(stream, num_rows, cfg.drafter.block_span, g_accum, start=rows_consumed)
    sender = Sender(layout, cfg.topology.prefetch, cfg.topology.timeout_s)
    eval_idx = eval_feature_rows(eval_rows, cfg) if layout.rank == 0 else []
    busy = 0.0
    try:
        for step in range(start_step, cfg.train.max_steps):
            rows, _ = plan.step()
            if rollouts is not None:
                drafter, eos, group = rollouts
                broadcast_drafter(drafter, group, layout, cfg.topology.timeout_s)
            for i, g in enumerate(rows):
                m = step * g_accum + i
                if m % t_ranks != layout.rank:
                    continue
                t0 = time.monotonic()
                row = _to(stream[g], device)
                if rollouts is None:
                    feats = produce_row_features(target, row, g, cfg)
                    busy += time.monotonic() - t0
                    parts = pack(ROW, m, g, feats, int(busy * 1e6))
                else:
                    made = produce_rollout_row(target, drafter, row, eos, cfg, g)
                    busy += time.monotonic() - t0
                    parts = pack_rollout(m, g, made, int(busy * 1e6), device)
                sender.send(t_ranks + i // (g_accum // d_ranks), parts)
            if eval_idx and is_eval_step(cfg, step + 1):
                for i in eval_idx:
                    row = _to(eval_rows[i], device)
                    feats = target.features(row.input_ids, row.position_ids, need_teacher=True)
                    sender.send(t_ranks, pack(EVAL_ROW, i, -1, _eval_message(row, feats), 0))
        sender.flush()
    except PeerError:
        if stop["flag"] is None:
            raise
        log(f"rank {layout.rank} (target): {stop['flag']}, the drafter stopped; exiting")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _to(row: PackedRow, device: torch.device) -> PackedRow:
    if device.type == "cpu":
        return row
    return PackedRow(row.input_ids.to(device), row.position_ids.to(device), row.loss_mask.to(device))


# -- the drafter rank's side ----------------------------------------------------------------------


class RemoteFeatures:
    """The drafter rank's stand-in for the target's ``features`` during an evaluation: the held-out
    rows' features as target rank 0 sent them, in the order the scorer asks for them."""

    def __init__(self, queue: list[TargetFeatures]):
        self.queue = deque(queue)

    def features(self, input_ids, position_ids=None, need_teacher=True) -> TargetFeatures:
        return self.queue.popleft()


class DrafterFeed:
    """A drafter rank's source of micro-batches and evaluation features, following the ``StepPlan``."""

    def __init__(
        self,
        cfg: RunConfig,
        layout: Layout,
        stream,
        num_rows: int,
        eval_rows,
        device,
        *,
        start_step: int,
        rows_consumed: int,
        weights_group=None,
    ):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.weights_group = weights_group  # the on-policy stage's (``weights_group``)
        self.plan = StepPlan(stream, num_rows, cfg.drafter.block_span, cfg.train.grad_accum, start=rows_consumed)
        self.receiver = Receiver(layout, cfg.drafter.block_span, device, cfg.topology.prefetch, cfg.topology.timeout_s)
        self.eval_count = len(eval_feature_rows(eval_rows, cfg)) if layout.drafter_index == 0 else 0
        self.target_busy_us: dict[int, int] = {}  # target rank -> its busy time so far, as it last reported
        self.step = start_step
        self._announced_step = start_step
        self._announce_ahead()

    def _announce(self, step: int) -> None:
        g_accum, t_ranks, d_ranks = self.cfg.train.grad_accum, self.layout.target_ranks, self.layout.drafter_ranks
        per = g_accum // d_ranks
        for i in range(self.layout.drafter_index * per, (self.layout.drafter_index + 1) * per):
            self.receiver.expect((step * g_accum + i) % t_ranks)
        if self.eval_count and is_eval_step(self.cfg, step + 1):
            for _ in range(self.eval_count):
                self.receiver.expect(0)

    def _announce_ahead(self) -> None:
        # announce whole steps ahead so that the receiver may prefetch across step boundaries
        while self._announced_step < min(self.cfg.train.max_steps, self.step + 2):
            self._announce(self._announced_step)
            self._announced_step += 1

    def take(self, g: int) -> RowFeatures:
        """The features of global row ``g``, the next micro-batch this rank trains on."""
        return self._take(g, (ROW,))

    def take_rollout(self, g: int) -> RolloutRow | None:
        """The on-policy stage's training row of global row ``g`` (None: the row had no rollout)."""
        return self._take(g, (ROLLOUT_ROW, NO_ROLLOUT))

    def _take(self, g: int, kinds: tuple[int, ...]):
        src, header, message = self.receiver.take()
        if int(header[0]) not in kinds or int(header[2]) != g:
            raise PeerError(
                f"rank {self.layout.rank}: expected row {g} from rank {src}, got message kind {int(header[0])} for "
                f"row {int(header[2])}: the ranks disagree on the step plan (different data or config?)"
            )
        self.target_busy_us[src] = int(header[9])
        return message

    def share_drafter(self, drafter) -> None:
        """Before a step of the on-policy stage: this step's weights to the target ranks, which draft with them."""
        broadcast_drafter(drafter, self.weights_group, self.layout, self.cfg.topology.timeout_s)

    def eval_features(self) -> RemoteFeatures:
        out = []
        for _ in range(self.eval_count):
            _, _, feats = self.receiver.take()
            out.append(TargetFeatures(feats.context, feats.teacher))
        return RemoteFeatures(out)

    def checkpointed(self, rows_consumed: int) -> None:
        pass  # features computed online: nothing on disk to release

    def end_step(self) -> None:
        self.step += 1
        self._announce_ahead()

    def metrics(self, elapsed: float) -> dict:
        """What the step's log record says about the transfer from the target ranks."""
        r, busy = self.receiver, self.target_busy_us
        return {
            "drafter_wait_s": r.wait_s,
            "bytes_received": r.bytes,
            "recv_bytes_per_s": r.bytes / max(elapsed, 1e-9),
            "target_busy_fraction": (sum(busy.values()) / 1e6 / len(busy) / max(elapsed, 1e-9)) if busy else None,
        }

    @staticmethod
    def postfix(record: dict) -> dict:
        """The progress bar's transfer fields."""
        return {"wait": f"{record['drafter_wait_s']:.0f}s", "MB_s": f"{record['recv_bytes_per_s'] / 1e6:.1f}"}

    def peer_error(self) -> BaseException | None:
        """The error the receiving thread saw (a target rank died or hung), if any."""
        return self.receiver.error
