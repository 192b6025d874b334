"""Optimizers and learning-rate schedules of a training run (``train.optimizer``, ``train.schedule``).

``adamw``: one ``torch.optim.AdamW`` (betas 0.9/0.95, decoupled weight decay on matrices only).
``muon``: ``torch.optim.Muon`` on the drafter's hidden matrices (``muon_matrices``: its 2-D parameters
but the variant's vocabulary tables, which Muon's authors would keep on AdamW like embeddings and
heads), its learning rate scaled by ``0.2 sqrt(max(A, B))`` so its update RMS matches AdamW's at the
same ``train.lr`` (torch's ``adjust_lr_fn="match_rms_adamw"``); AdamW on everything else (norms,
biases, the vocabulary tables). torch runs Muon's Newton-Schulz iteration in bf16 always; ``Muon``
here runs it in bf16 only where the device multiplies bf16 natively and in fp32 elsewhere (a CPU
without AVX512-BF16 or AMX emulates bf16 GEMMs: a 256 x 768 matrix's five iterations took 262 ms
in bf16 against 6.6 ms in fp32, measured with oneDNN limited to AVX2), the same operations in the same order otherwise (bit for bit
torch's step in bf16: tests/test_optim.py). Both follow the same schedule factor of the step:

    cosine   warmup, then 0.5 (1 + cos(pi t)) from 1 to min_lr_ratio
    linear   warmup, then a line from 1 to min_lr_ratio
    wsd      warmup, 1 until the last decay_ratio of the steps, then a line to min_lr_ratio

where ``t`` is the share of the post-warmup steps done. ``train.epochs`` turns into ``max_steps`` once
the number of training rows is known (``resolve_epochs``).
"""

from __future__ import annotations

import math

import torch

from ..config import RunConfig
from ..precision import muon_ns_dtype
from ..variants import variant_of

MUON_LR_MATCH = "match_rms_adamw"


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype):
    """Muon's quintic Newton-Schulz orthogonalization of ``update`` ``[A, B]`` in ``dtype``: torch.optim.Muon's
    iteration (Keller Jordan's coefficients; X <- a X + (b G + c G^2) X with G = X X^T, on the wide
    orientation, X first scaled to Frobenius norm 1) with the working precision a parameter."""
    x = update.to(dtype, copy=True)  # a copy even in fp32: without Nesterov ``update`` is the momentum buffer
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (its arguments, checks and state: a ``momentum_buffer`` per matrix) whose
    Newton-Schulz iteration runs in ``ns_dtype`` (``precision.muon_ns_dtype``: bf16, torch's choice,
    where bf16 GEMMs are native; fp32 elsewhere). The update is torch's: momentum, Nesterov, decoupled
    weight decay, the learning rate adjusted per shape (only ``match_rms_adamw`` and ``original``)."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, decay = float(group["lr"]), group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                a, b = p.shape[:2]
                if group["adjust_lr_fn"] == MUON_LR_MATCH:
                    scale = 0.2 * math.sqrt(max(a, b))
                else:  # torch's "original" (its default)
                    scale = math.sqrt(max(1, a / b))
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr * scale)
        return loss


def steps_for_epochs(epochs: float, num_rows: int, grad_accum: int) -> int:
    """Optimizer steps that consume ``epochs`` passes over ``num_rows`` rows, ``grad_accum`` rows a step."""
    return max(1, math.ceil(epochs * num_rows / grad_accum))


def resolve_epochs(cfg: RunConfig, num_rows: int) -> RunConfig:
    """``cfg`` with ``train.max_steps`` derived from ``train.epochs`` (unchanged when epochs is not set)."""
    if cfg.train.epochs is None:
        return cfg
    steps = steps_for_epochs(cfg.train.epochs, num_rows, cfg.train.grad_accum)
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": steps})})


def schedule_factor(cfg: RunConfig):
    """``step -> lr / train.lr`` for steps ``0 .. max_steps - 1`` (see the module docstring)."""
    tr = cfg.train
    total, floor = tr.max_steps, tr.min_lr_ratio
    warmup = int(tr.warmup_ratio * total)
    decay_start = max(warmup, total - math.ceil(tr.decay_ratio * total)) if tr.schedule == "wsd" else warmup

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, max(0, step - decay_start) / max(1, total - decay_start))
        if tr.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        return floor + (1 - floor) * (1 - t)  # linear, and wsd (t stays 0 until its decay starts)

    return fn


def muon_matrices(drafter) -> list[torch.nn.Parameter]:
    """The parameters ``train.optimizer=muon`` updates with Muon: the drafter's hidden matrices (every
    trainable 2-D parameter but the variant's vocabulary-sized tables: Muon's authors keep embeddings
    and heads on AdamW). By name, not by shape: an MLP as wide as the vocabulary is still a matrix."""
    tables = set(variant_of(drafter.spec).vocabulary_tables)
    return [p for n, p in drafter.named_parameters() if p.requires_grad and p.dim() == 2 and n not in tables]


class Optimizers:
    """The run's optimizers and their schedulers, stepped together. ``state_dict`` keys: ``optimizer``
    and ``scheduler`` (AdamW, always present), ``muon_optimizer`` and ``muon_scheduler`` (Muon only)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: RunConfig, muon: list[torch.nn.Parameter]):
        """``params``: every parameter; ``muon``: those Muon updates under ``train.optimizer=muon``
        (``muon_matrices``), ignored under adamw."""
        tr = cfg.train
        params = [p for p in params if p.requires_grad]
        muon = list(muon) if tr.optimizer == "muon" else []
        in_muon = {id(p) for p in muon}
        rest = [p for p in params if id(p) not in in_muon]
        decay = [p for p in rest if p.dim() > 1]
        no_decay = [p for p in rest if p.dim() <= 1]
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tr.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tr.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        self.muon = (
            Muon(
                muon,
                ns_dtype=muon_ns_dtype(muon[0].device.type),
                lr=tr.lr,
                weight_decay=tr.muon_weight_decay,
                momentum=tr.muon_momentum,
                nesterov=True,
                adjust_lr_fn=MUON_LR_MATCH,
            )
            if muon
            else None
        )
        factor = schedule_factor(cfg)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.all]

    @property
    def all(self) -> list[torch.optim.Optimizer]:
        return [self.adamw] + ([self.muon] if self.muon is not None else [])

    def zero_grad(self) -> None:
        for o in self.all:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        """One optimizer step of every optimizer, then one scheduler step."""
        for o in self.all:
            o.step()
        for s in self.schedulers:
            s.step()

    @property
    def lr(self) -> float:
        """The learning rate of the next step (``train.lr`` times the schedule factor)."""
        return self.schedulers[0].get_last_lr()[0]

    def state(self) -> list[dict]:
        """The per-parameter states of every optimizer (for inspection: dtypes, sizes)."""
        return [st for o in self.all for st in o.state.values()]

    def state_dict(self) -> dict:
        out = {"optimizer": self.adamw.state_dict(), "scheduler": self.schedulers[0].state_dict()}
        if self.muon is not None:
            out.update(muon_optimizer=self.muon.state_dict(), muon_scheduler=self.schedulers[1].state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` saved; a checkpoint of the other optimizer is refused by the
        resume's settings check (``train.optimizer`` changes what a step computes) before this runs."""
        self.adamw.load_state_dict(state["optimizer"])
        self.schedulers[0].load_state_dict(state["scheduler"])
        if self.muon is not None:
            self.muon.load_state_dict(state["muon_optimizer"])
            self.schedulers[1].load_state_dict(state["muon_scheduler"])
