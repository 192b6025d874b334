"""The seed's step at its true shapes, traced with torch's MemTracker on fake CPU tensors, against the planner.

    .venv/bin/python benchmarks/bench_meta_trace.py            # writes benchmarks/results/meta_trace.{json,md}
    .venv/bin/python benchmarks/bench_meta_trace.py --small    # the same code at toy shapes (the test's run)

No memory is allocated: every tensor is a ``FakeTensor`` (shapes, dtypes, a CPU device), so the
drafter rank's whole step of ``ddtree-experiment`` (H = 5,120, 5 layers, a 65,536-token row, 1,024 x 24
anchors, V = 248,320, bf16 autocast with fp32 master weights, activation checkpointing, AdamW) and the
target rank's body forward (Qwen3.6-27B: 64 layers, 48 of them Gated DeltaNet) run in seconds on a
laptop. ``MemTracker`` (``torch.distributed._tools.mem_tracker``) attributes every storage to
parameters, activations, temporaries, gradients or optimizer states and records each module's peak in
forward and backward; the phases are read where the planner draws them:

    drafter forward   the drafter module's forward peak
    loss              the fused loss's forward peak (wrapped in a module for the tracker)
    backward          the larger of the loss's and the drafter's backward peaks (layers recomputed)
    optimizer         AdamW's step, traced by a second tracker (gradients, states and parameters alive)
    target forward    the target body's forward peak under no_grad, hooks capturing the five layers

What the trace cannot follow on the CUDA path is priced separately, not traced: FlexAttention's
compiled kernels (the attention call is a stand-in op whose outputs are flex's: the output and its
logsumexp, and in the backward the three input gradients), the fused loss's chunk workspace (the op is
opaque; ``planner.loss_workspace`` prices it and ``tests/test_planner.py`` measures it with the
allocator), the next row in flight (a second process's buffer), the CUDA context, NCCL's buffers and
the allocator's fragmentation (the planner's runtime reserve and margin, outside its phase totals).
On the fake CPU device AdamW runs with ``foreach=True``, as on CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _ModState

from dflash_trainer.config import load_config
from dflash_trainer.data.blocks import build_blocks, sample_anchors
from dflash_trainer.data.packing import doc_ids_from_positions
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.planner.plan import _target_layer_ids, drafter_phases, target_phases
from dflash_trainer.planner.shapes import load_target_shape
from dflash_trainer.training.step import StepBatch, draft_loss

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 0.10
SEED = ["ddtree-experiment"], ["target.path=null", "topology.target_model=qwen3.6-27b"]
SMALL = [
    "data.seq_len=2048",
    "data.max_anchors=32",
    "drafter.block_size=8",
    "drafter.sliding_window=256",
    "target.layer_ids=[1,2,3,4,5]",
]
# What the planner prices that the trace cannot see (see the module docstring).
NOT_TRACED = ("next row's features (in flight)",)


# -- the attention stand-in: flex's outputs and gradients, no scores ----------------------------


@torch.library.custom_op("dflash_bench::flex_stand_in", mutates_args=())
def flex_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [1, Hq, Q, d]``, ``k``/``v`` ``[1, Hkv, K, d]`` -> output like ``q`` and the fp32 logsumexp ``[1, Hq, Q]``."""
    raise RuntimeError("flex_stand_in only traces (fake tensors)")


@flex_stand_in.register_fake
def _(q, k, v):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("dflash_bench::flex_stand_in_backward", mutates_args=())
def flex_stand_in_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise RuntimeError("flex_stand_in only traces (fake tensors)")


@flex_stand_in_backward.register_fake
def _(q, k, v, out, lse, grad):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, grad, _grad_lse):
    return flex_stand_in_backward(*ctx.saved_tensors, grad)


flex_stand_in.register_autograd(_backward, setup_context=_setup)


def sdpa_as_flex(q, k, v, attn_mask=None, enable_gqa=False, **_):
    return flex_stand_in(q, k, v)[0]


@contextmanager
def attention_stand_in():
    """The drafter's attention call (``F.scaled_dot_product_attention``, read at call time) as flex's outputs."""
    F = torch.nn.functional
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa_as_flex
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# -- the traced step ---------------------------------------------------------------------------------


class LossPhase(torch.nn.Module):
    """The fused loss as a module, so that MemTracker records its forward and backward peaks."""

    def __init__(self, drafter, cfg):
        super().__init__()
        self.drafter, self.cfg = (drafter,), cfg

    def forward(self, batch: StepBatch) -> torch.Tensor:
        return draft_loss(self.drafter[0], batch, self.cfg)[0]


def target_config(shape):
    from transformers import Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    c = {k: v for k, v in shape.config.items() if k != "model_type"}
    return Qwen3_5TextConfig(**c) if shape.model_type == "qwen3_5_text" else Qwen3Config(**c)


def row_blocks(cfg, spec, fake):
    """A row's anchors and blocks, computed for real (small integer tensors), then made fake."""
    L, B, n = cfg.data.seq_len, spec.block_size, cfg.data.max_anchors
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, spec.vocab_size, (L,), generator=g)
    positions = torch.arange(L)
    loss_mask = torch.ones(L, dtype=torch.long)
    anchors = sample_anchors(loss_mask, doc_ids_from_positions(positions), B, n, g)
    blocks = build_blocks(
        ids,
        positions,
        loss_mask,
        anchors,
        block_size=B,
        mask_token_id=spec.mask_token_id,
        gamma=cfg.loss.gamma,
        num_blocks=n,
    )
    to_fake = fake.from_tensor
    return {
        "ids": to_fake(ids),
        "positions": to_fake(positions),
        "block_ids": to_fake(blocks.input_ids),
        "block_positions": to_fake(blocks.position_ids),
        "labels": to_fake(blocks.labels.reshape(-1)),
        "weights": to_fake(blocks.weights.reshape(-1)),
        "slots": to_fake(torch.arange(B).repeat(n)),
        "row": [to_fake(t) for t in (ids, positions, loss_mask, anchors)],
    }


def peak(tracker: MemTracker, module, state) -> int:
    stats = tracker.memory_tracking[module]
    return max(snap[torch.device("cpu")]["Total"] for snap in stats.snapshots[state])


def trace_drafter(cfg, shape) -> dict:
    fake = FakeTensorMode()
    hf = target_config(shape)
    k, h, v = (
        len(_target_layer_ids(shape, plan_workload(cfg), cfg.target.layer_ids)),
        shape.hidden_size,
        shape.vocab_size,
    )
    t = torch.bfloat16  # target dtype: embedding, head, features
    spec = DrafterSpec.from_target(hf, cfg.drafter, num_features=k, mask_token_id=3)
    r = row_blocks(cfg, spec, fake)  # real integers first, then fake copies
    with fake:
        embed = torch.nn.Embedding(v, h, dtype=t).requires_grad_(False)
        head = torch.empty(v, h, dtype=t)
        drafter = DFlashDrafter(spec, embed, head).train()
        params = [p for p in drafter.parameters()]
        optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() <= 1]}],
            lr=1e-4,
            betas=(0.9, 0.95),
            foreach=True,  # CUDA's default
        )
        for p in params:  # AdamW's states exist from the second step on (the planner's steady state)
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        L, n_rows = cfg.data.seq_len, r["labels"].shape[0]
        context = torch.empty(L, k * h, dtype=t)
        teacher = torch.empty(n_rows, h, dtype=t)
        loss_phase = LossPhase(drafter, cfg)
        masks = {m: None for m in set(drafter.mask_specs)}

        tracker = MemTracker()
        tracker.track_external(drafter, optimizer, embed, head, context, teacher, *r["row"])
        tracker.track_external(*[x for key, x in r.items() if key != "row"])
        with tracker, attention_stand_in():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.dtype == "bfloat16"):
                hidden = drafter(r["block_ids"], r["block_positions"], context, r["positions"], masks, "dense")
            batch = StepBatch(hidden, teacher, r["labels"], r["weights"], r["slots"])
            loss = loss_phase(batch)
            del hidden, batch
            loss.backward()
            del loss
        phases = {
            "drafter forward": peak(tracker, drafter, _ModState.PEAK_FW),
            "loss": peak(tracker, loss_phase, _ModState.PEAK_FW),
            "backward": max(peak(tracker, loss_phase, _ModState.PEAK_BW), peak(tracker, drafter, _ModState.PEAK_BW)),
        }
        by_kind = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]

        opt_tracker = MemTracker()
        opt_tracker.track_external(drafter, optimizer, embed, head, context, teacher, *r["row"])
        with opt_tracker:
            optimizer.step()
        phases["optimizer"] = opt_tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"phases": phases, "peak_by_category": {str(getattr(k, "value", k)): v for k, v in by_kind.items()}}


def trace_target(cfg, shape) -> dict:
    """The target rank's body forward (no lm_head), hooks keeping the captured layers, under no_grad."""
    from transformers import AutoModelForCausalLM

    fake = FakeTensorMode()
    hf = target_config(shape)
    ids_layers = _target_layer_ids(shape, plan_workload(cfg), cfg.target.layer_ids)
    L = cfg.data.seq_len
    with fake:
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).eval()
        body = model.model
        del model.lm_head
        ids = fake.from_tensor(torch.randint(4, shape.vocab_size, (1, L)))
        positions = fake.from_tensor(torch.arange(L)[None])
        captured = []
        hooks = [
            body.layers[i].register_forward_hook(
                lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
            )
            for i in ids_layers
        ]
        t0 = time.perf_counter()
        hooks += [  # progress: 65,536 tokens through 48 torch-fallback recurrences take many minutes
            layer.register_forward_pre_hook(
                lambda _m, _a, i=i: print(f"  target layer {i} at {time.perf_counter() - t0:.0f} s", flush=True)
            )
            for i, layer in enumerate(body.layers)
            if i % 8 == 0
        ]
        tracker = MemTracker()
        tracker.track_external(body, ids, positions)
        with tracker, torch.no_grad():
            out = body(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            feats = torch.cat([c[0] for c in captured], dim=-1)
            del out
        for hk in hooks:
            hk.remove()
        result = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        del feats
    return {
        "phases": {"target forward": result["Total"]},
        "peak_by_category": {str(getattr(k, "value", k)): v for k, v in result.items()},
    }


def plan_workload(cfg):
    from dflash_trainer.planner.report import workload_from_config

    return workload_from_config(cfg)


def planner_phases(cfg, shape) -> dict:
    from dflash_trainer.planner.plan import make_plan
    from dflash_trainer.planner.report import topology_for

    plan = make_plan(shape, plan_workload(cfg), topology_for(cfg, None, None, None), cfg.target.layer_ids)
    s, w, topo = plan.target, plan.workload, plan.topology
    ids = _target_layer_ids(s, w, cfg.target.layer_ids)
    items = drafter_phases(s, w, topo, ids, plan.chunk)
    from dflash_trainer.planner import formulas as F

    loss_ws = F.loss_workspace(w, s.vocab_size, s.hidden_size, plan.chunk, 1.0, True)
    drafter = {}
    for phase in ("drafter forward", "loss", "backward", "optimizer"):
        v = items[phase]
        untraced = {name: v[name] for name in NOT_TRACED if name in v}
        if phase == "loss":  # the op's chunk buffers and transients stay inside it
            untraced["fused loss chunk workspace"] = loss_ws["chunk buffers"] + loss_ws["chunk transient"]
        drafter[phase] = {"total": sum(v.values()), "untraced": untraced}
    target = sum(target_phases(s, w, ids, False).values())
    return {"drafter": drafter, "target forward": target, "chunk": plan.chunk}


def compare(cfg, shape, roles=("drafter", "target")) -> dict:
    planned = planner_phases(cfg, shape)
    out = {"rows": [], "chunk": planned["chunk"], "trace_seconds": {}}
    if "drafter" in roles:
        t0 = time.perf_counter()
        drafter = trace_drafter(cfg, shape)
        out["trace_seconds"]["drafter"] = time.perf_counter() - t0
        for phase, traced in drafter["phases"].items():
            p = planned["drafter"][phase]
            comparable = p["total"] - sum(p["untraced"].values())
            out["rows"].append(_row("drafter rank", phase, traced, comparable, p["untraced"]))
        out["drafter_peak_by_category"] = drafter["peak_by_category"]
    if "target" in roles:
        t0 = time.perf_counter()
        target = trace_target(cfg, shape)
        out["trace_seconds"]["target"] = time.perf_counter() - t0
        traced = target["phases"]["target forward"]
        out["rows"].append(_row("target rank", "target forward", traced, planned["target forward"], {}))
        out["target_peak_by_category"] = target["peak_by_category"]
    return out


def _row(role, phase, traced, planned, untraced) -> dict:
    return {
        "role": role,
        "phase": phase,
        "traced_bytes": traced,
        "planned_bytes": planned,
        "difference": planned / traced - 1,
        "within_goal": abs(planned / traced - 1) <= GOAL,
        "priced_separately": untraced,
    }


def markdown(result: dict, meta: dict) -> str:
    gb = 1e9
    lines = [
        f"# Meta trace vs planner ({meta['date']}, torch {meta['torch']}{', --small' if meta['small'] else ''})",
        "",
        f"`{meta['command']}`. `MemTracker` on fake CPU tensors (nothing allocated), the seed's "
        f"`ddtree-experiment` with the Qwen3.6-27B target{' at toy shapes' if meta['small'] else ''}; "
        f"loss chunk {result['chunk']} rows. Planned = the planner's phase total minus what the trace cannot "
        "see (priced separately). GB = 1e9 bytes; goal: within 10%.",
        "",
        "| role | phase | traced GB | planned GB | planned / traced - 1 | priced separately (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        sep = ", ".join(f"{k} {v / gb:.2f}" for k, v in r["priced_separately"].items()) or "-"
        lines.append(
            f"| {r['role']} | {r['phase']} | {r['traced_bytes'] / gb:.2f} | {r['planned_bytes'] / gb:.2f} | "
            f"{r['difference']:+.1%} | {sep} |"
        )
    for role in ("drafter", "target"):
        if f"{role}_peak_by_category" in result:
            cats = result[f"{role}_peak_by_category"]
            cats = ", ".join(f"{k} {v / gb:.2f}" for k, v in cats.items() if k != "Total" and v)
            lines += ["", f"The {role} rank at its traced peak, by MemTracker category (GB): {cats}."]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="toy shapes (seconds; what the test runs)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--roles", default="drafter,target", help="drafter, target or both (the default)")
    args = ap.parse_args(argv)
    cfg = load_config(SEED[0], [*SEED[1], *(SMALL if args.small else [])])
    shape = load_target_shape("qwen3.6-27b")
    if args.small:  # an 8-layer hybrid of the same kind at hidden 256, vocabulary 4,096
        small = dict(shape.config, hidden_size=256, intermediate_size=512, num_hidden_layers=8, vocab_size=4096)
        small.update(num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4)
        small.update(linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)
        small["layer_types"] = 2 * ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        shape = type(shape).from_config(small, "qwen3.6-27b, toy shapes")
    roles = tuple(x.strip() for x in args.roles.split(","))
    result = compare(cfg, shape, roles)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "small": args.small,
        "command": "python benchmarks/bench_meta_trace.py"
        + " ".join([""] + (argv if argv is not None else sys.argv[1:])),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "meta_trace.json").write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
    (args.out / "meta_trace.md").write_text(markdown(result, meta))
    print(markdown(result, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
