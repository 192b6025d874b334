"""The CUDA path in one prepared command: flex attention, bf16, the fused loss at the seed's shape, a
training step at scale against the planner, and speculative decoding on the GPU.

    python benchmarks/gpu_check.py                        # one CUDA GPU, < 8 min: benchmarks/results/gpu.{md,json}
    python benchmarks/gpu_check.py --small --device cpu --out /tmp/gpu-check   # the same code at toy sizes
    python benchmarks/gpu_check.py --sections loss,step --budget 300

Sections (each catches its own failure and records it, so one failure does not lose the others; the
two result files are rewritten after every section, so a run cut short keeps what it measured):

  attention    the drafter with the flex backend (compiled on CUDA) vs the dense backend on the same
               blocks of a row with three documents, fp32 and bf16 autocast: forward and gradient
               differences, each also against a float64 dense reference; a sliding-window layer and a
               full layer, block-causal sliding windows too. On the CPU flex has no backward: the CPU
               compares forwards only.
  loss         the fused loss at N = 24,576, H = 5,120, V = 248,320, bf16 head, CE + 15% KL + CAP: time
               and peak memory above the inputs, against Liger's LigerFusedLinearJSDLoss (chunked,
               torch.compile'd) and LigerFusedLinearCrossEntropyLoss (Triton), and the plain full-logits
               reference, whose out-of-memory error is the expected result at this shape. GEMM efficiency =
               GEMM FLOPs / time / the measured bf16 matmul throughput of the chunk's shape.
  step         Trainer.train_step at the ddtree-experiment settings (65,536-token row, 1,024 anchors x 24,
               sliding windows, KL, CAP, noise, activation checkpointing, flex, bf16) with a random-init
               target of the seed's vocabulary and hidden size but 6 layers: steps/s, tokens/s, and the
               peak allocated memory of each phase (the profiler's allocator events inside the
               ``dflash-phase:<name>`` ranges, plus torch.cuda.max_memory_allocated for the whole step)
               against the planner's prediction for the same shapes (goal: within 10%).
  speculative  the embedded tiny target on the device, a drafter trained there for a few hundred steps
               on the target's own greedy continuations, then chain and DDTree speculative decoding of
               held-out prompts: identical to target-only greedy decoding (lossless), tau, tokens/s.

``--small`` runs every section at toy sizes (seconds on a CPU); the test suite runs it on the CPU so
that the GPU run cannot fail on a typo. Where a GPU behaves differently (compiled flex, CUDA memory
statistics, Triton kernels) the code paths are the same functions with the device as a parameter.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("attention", "loss", "step", "speculative")
# Seconds each section may take at most on the GPU (it is cut with an error record when over); the
# sum stays under the 8-minute goal with room for start-up.
SECTION_CAPS = {"attention": 100, "loss": 90, "step": 170, "speculative": 90}
DEFAULT_BUDGET = 450  # seconds for all sections together


@dataclass(frozen=True)
class Sizes:
    """Every size the sections use; ``GPU`` is the real check, ``SMALL`` the CPU smoke run."""

    # attention parity: the seed's attention geometry (heads, KV heads, head dim), a small hidden size
    attn_hidden: int
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    attn_docs: tuple[int, ...]  # document lengths of the row (the row is their sum)
    attn_anchors: int
    attn_block: int
    attn_window: int
    # fused loss
    loss_n: int
    loss_h: int
    loss_v: int
    loss_chunk: int
    loss_reps: int
    # training step at scale
    step_target: dict  # Qwen3 config fields of the random-init target
    step_overrides: tuple[str, ...]  # on top of the ddtree-experiment preset
    step_docs: int
    step_timed: int
    # speculative decoding on the tiny target
    spec_train_prompts: int
    spec_eval_prompts: int
    spec_gen_tokens: int  # length of the regenerated training responses
    spec_decode_tokens: int
    spec_train_steps: int
    spec_budgets: tuple[int, ...]
    budget_scale: float = 1.0  # SECTION_CAPS multiplier


def _seed_target(layers: int) -> dict:
    """A dense Qwen3 with the seed target's hidden size, vocabulary and attention geometry (so the
    drafter is exactly the seed's) but ``layers`` layers; see ``section_step`` for why dense."""
    from dflash_trainer.planner.shapes import TARGET_PRESETS

    seed = TARGET_PRESETS["qwen3.6-27b"][0]
    keys = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    return {"model_type": "qwen3", **{k: seed[k] for k in keys}, "num_hidden_layers": layers}


def gpu_sizes() -> Sizes:
    return Sizes(
        attn_hidden=1024,
        attn_heads=24,
        attn_kv_heads=4,
        attn_head_dim=256,
        attn_docs=(1500, 1300, 1296),
        attn_anchors=128,
        attn_block=24,
        attn_window=512,
        loss_n=24_576,
        loss_h=5120,
        loss_v=248_320,
        loss_chunk=1024,  # the planner's largest derived chunk (planner.plan.MAX_DERIVED_CHUNK)
        loss_reps=2,
        step_target=_seed_target(6),
        step_overrides=(),  # the preset as it is: 65,536-token rows, 1,024 x 24
        step_docs=1,
        step_timed=3,
        spec_train_prompts=64,
        spec_eval_prompts=8,
        spec_gen_tokens=128,
        spec_decode_tokens=128,
        spec_train_steps=300,
        spec_budgets=(16, 64),
    )


def small_sizes() -> Sizes:
    target = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 192,
        "vocab_size": 4096,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 6,
    }
    return Sizes(
        attn_hidden=64,
        attn_heads=4,
        attn_kv_heads=2,
        attn_head_dim=16,
        attn_docs=(70, 60, 62),
        attn_anchors=12,
        attn_block=4,
        attn_window=24,
        loss_n=256,
        loss_h=64,
        loss_v=2048,
        loss_chunk=64,
        loss_reps=1,
        step_target=target,
        step_overrides=(
            "data.seq_len=512",
            "data.max_anchors=16",
            "drafter.block_size=8",
            "drafter.sliding_window=64",
            "drafter.attention_backend=dense",  # the CPU has no flex backward
        ),
        step_docs=1,
        step_timed=2,
        spec_train_prompts=12,
        spec_eval_prompts=2,
        spec_gen_tokens=32,
        spec_decode_tokens=24,
        spec_train_steps=10,
        spec_budgets=(4,),
        budget_scale=3.0,  # a shared 2-core CPU is slow; the test's own timeout guards it
    )


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    small: bool
    log: callable = print
    # A section's result as far as it got: kept in the record when the section fails or runs out of time.
    partial: dict = field(default_factory=dict)


class SectionTimeout(Exception):
    pass


# -- helpers ------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fresh_compile_caches() -> None:
    """Each section compiles for itself: the sections run flex for many shapes, dtypes and mask
    variants, and past dynamo's recompile limit (8 per function) a compiled function silently runs
    eagerly, which for flex on a GPU means materialized scores (hundreds of GB at the step's size)."""
    import torch._dynamo

    torch._dynamo.reset()
    for limit in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def median_time(fn, device: torch.device, reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls (the caller has warmed it up)."""
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_extra_bytes(fn, device: torch.device) -> tuple[object, int]:
    """``(fn(), peak bytes allocated during the call above what was allocated before it)``: CUDA's
    allocator statistics on a GPU, the CPU allocator's profiler events elsewhere."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        sync(device)
        return out, torch.cuda.max_memory_allocated(device) - base
    from planner_measure import allocator_peak

    out, extra, _ = allocator_peak(fn, "cpu")
    return out, extra


def allocated_now(device: torch.device) -> int:
    """Bytes of tensors alive now on ``device`` (the start of a measured step)."""
    if device.type == "cuda":
        sync(device)
        return torch.cuda.memory_allocated(device)
    from planner_measure import live_tensor_bytes

    return live_tensor_bytes()


@contextmanager
def cuda_phase_peaks(device: torch.device, peaks: dict):
    """While active, each ``dflash-phase:<name>`` range of the training step (``training.step.phase``)
    also records ``torch.cuda.max_memory_allocated`` over the phase into ``peaks[name]``, and the
    peak of the whole stretch into ``peaks["step"]``. CUDA only: the CPU has no allocator peak."""
    import dflash_trainer.training.step as step_module
    import dflash_trainer.training.trainer as trainer_module

    original = step_module.phase

    @contextmanager
    def measured(name: str):
        sync(device)
        peaks["step"] = max(peaks.get("step", 0), torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        with original(name):
            yield
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        peaks[name] = max(peaks.get(name, 0), peak)
        peaks["step"] = max(peaks.get("step", 0), peak)

    step_module.phase = trainer_module.phase = measured
    try:
        yield peaks
    finally:
        step_module.phase = trainer_module.phase = original
        sync(device)
        peaks["step"] = max(peaks.get("step", 0), torch.cuda.max_memory_allocated(device))


def device_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return int(p.total_memory), p.name
    from dflash_trainer.planner.report import available_ram

    return available_ram(), "this machine's RAM (available)"


def matmul_flops(c: int, h: int, v: int, dtype: torch.dtype, device: torch.device) -> float:
    """Measured FLOP/s of the chunk's GEMM ``[c, H] @ [V, H]^T`` in ``dtype`` (best of several)."""
    a = torch.randn(c, h, device=device).to(dtype)
    b = torch.randn(v, h, device=device).to(dtype)
    a @ b.T  # warm-up (cuBLAS heuristics, lazy init)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            a @ b.T
        sync(device)
        best = min(best, (time.perf_counter() - t0) / 3)
    return 2 * c * h * v / best


# -- 1. attention parity ------------------------------------------------------------------------


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| in float64."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()


def _grad_rel(g: dict, ref: dict) -> float:
    """The worst parameter: max over parameters of max |g - ref| / max |ref|."""
    return max(_rel(g[n], ref[n]) for n in ref)


def section_attention(ctx: Context) -> dict:
    from dflash_trainer.data.blocks import build_blocks, sample_anchors
    from dflash_trainer.data.packing import doc_ids_from_positions
    from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec

    s, dev = ctx.sizes, ctx.device
    vocab, features = 512, 2
    torch.manual_seed(0)  # the embedding's init
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(n) for n in s.attn_docs])
    length = pos.numel()
    doc = doc_ids_from_positions(pos)
    ids = torch.randint(4, vocab, (length,), generator=g)
    loss_mask = torch.ones(length, dtype=torch.long)
    anchors = sample_anchors(loss_mask, doc, s.attn_block, s.attn_anchors, g)
    blocks = build_blocks(ids, pos, loss_mask, anchors, block_size=s.attn_block, mask_token_id=3, gamma=4.0)
    feats = torch.randn(length, features * s.attn_hidden, generator=g)
    n_q = anchors.numel() * s.attn_block
    proj = torch.randn(n_q, s.attn_hidden, generator=g)  # a fixed direction to backpropagate
    # The drafter shares these with the target and does not move them: they live on the device already.
    embed = torch.nn.Embedding(vocab, s.attn_hidden).to(dev)
    head = (torch.randn(vocab, s.attn_hidden, generator=g) * 0.02).to(dev)
    to = dict(device=dev)
    inputs = [t.to(**to) for t in (blocks.input_ids, blocks.position_ids, feats, pos)]
    mask_args = [t.to(**to) for t in (blocks.anchors, blocks.doc_ids, doc)]
    grads_on_device = dev.type == "cuda"  # FlexAttention has no backward on the CPU

    def run(drafter, backend: str, bf16: bool, want_grad: bool, dtype=None):
        block_ids, block_pos, f, ctx_pos = inputs
        f = f.to(dtype) if dtype is not None else f
        masks = drafter.build_masks(*mask_args, backend)
        drafter.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(want_grad), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            out = drafter(block_ids, block_pos, f, ctx_pos, masks, backend)
        grads = None
        if want_grad:
            (out.to(proj.dtype if dtype is None else dtype) * proj.to(dev, dtype or proj.dtype)).sum().backward()
            grads = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}
        sync(dev)
        return out.detach(), grads

    rows: list[dict] = []
    result = {
        "shape": {
            "row_tokens": length,
            "documents": list(s.attn_docs),
            "queries": n_q,
            "blocks": f"{anchors.numel()} x {s.attn_block}",
            "window": s.attn_window,
            "hidden": s.attn_hidden,
            "heads": f"{s.attn_heads} (kv {s.attn_kv_heads}) x {s.attn_head_dim}",
        },
        "rows": rows,
    }
    ctx.partial = result
    for causal in (False, True):
        spec = DrafterSpec(
            hidden_size=s.attn_hidden,
            num_heads=s.attn_heads,
            num_kv_heads=s.attn_kv_heads,
            head_dim=s.attn_head_dim,
            intermediate_size=2 * s.attn_hidden,
            vocab_size=vocab,
            num_layers=2,
            num_features=features,
            block_size=s.attn_block,
            sliding_window_layers=(0,),  # layer 0 sliding window, layer 1 full attention
            sliding_window=s.attn_window,
            causal_in_block_sliding=causal,
            mask_token_id=3,
        )
        torch.manual_seed(0)
        drafter = DFlashDrafter(spec, embed, head)
        for p in drafter.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
        ref_model = copy.deepcopy(drafter).double().to(dev)  # float64 dense: the reference
        drafter = drafter.to(dev)
        ref_out = ref_grads = ref_error = None
        try:
            ref_out, ref_grads = run(ref_model, "dense", False, True, dtype=torch.float64)
        except Exception as exc:  # flex vs dense still says something without it
            ref_error = first_line(exc)
        del ref_model
        for dtype_name, bf16 in (("fp32", False), ("bf16 autocast", True)):
            row = {"layers": "sliding (block-causal) + full" if causal else "sliding + full", "dtype": dtype_name}
            if ref_error:
                row["fp64_reference_error"] = ref_error
            ctx.log(f"  attention: {row['layers']}, {dtype_name}")
            try:
                dense_out, dense_grads = run(drafter, "dense", bf16, True)
                flex_out, flex_grads = run(drafter, "flex", bf16, grads_on_device)
                row["fwd_flex_vs_dense"] = _rel(flex_out, dense_out)
                if ref_out is not None:
                    row.update(fwd_dense_vs_fp64=_rel(dense_out, ref_out), fwd_flex_vs_fp64=_rel(flex_out, ref_out))
                if ref_grads is not None:
                    row["grad_dense_vs_fp64"] = _grad_rel(dense_grads, ref_grads)
                if flex_grads is not None:
                    row["grad_flex_vs_dense"] = _grad_rel(flex_grads, dense_grads)
                    if ref_grads is not None:
                        row["grad_flex_vs_fp64"] = _grad_rel(flex_grads, ref_grads)
                else:
                    row["grad"] = "not available on CPU (FlexAttention has no CPU backward)"
                row["pass"] = _attention_pass(row, bf16)
            except Exception as exc:  # one case failing (e.g. a kernel limit) keeps the others
                row.update(error=first_line(exc), **{"pass": False})
            rows.append(row)
            free_memory(dev)
    result["ok"] = all(r["pass"] for r in rows)
    return result


# Absolute slack of the parity rule: flex's error against float64 may be at most twice the dense
# backend's (both run the same precision) plus this. Without the float64 reference: flex against
# dense within FALLBACK_TOLERANCE.
PARITY_SLACK = {False: 1e-5, True: 1e-3}
FALLBACK_TOLERANCE = {False: 1e-4, True: 5e-2}


def _attention_pass(row: dict, bf16: bool) -> bool:
    ok = True
    for kind in ("fwd", "grad"):
        if f"{kind}_flex_vs_fp64" in row:
            ok &= row[f"{kind}_flex_vs_fp64"] <= 2 * row[f"{kind}_dense_vs_fp64"] + PARITY_SLACK[bf16]
        elif f"{kind}_flex_vs_dense" in row:
            ok &= row[f"{kind}_flex_vs_dense"] <= FALLBACK_TOLERANCE[bf16]
    return bool(ok)


# -- 2. fused loss at the seed's shape ------------------------------------------------------------

LOSS_TERMS = {"kl_weight": 0.15, "temperature": 1.0, "cap_weight": 0.1}  # LossTerms fields


def _as_loss(out) -> torch.Tensor:
    """Liger's modules return a tensor or a tuple/dataclass whose first field is the loss."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.loss


def section_loss(ctx: Context) -> dict:
    from dflash_trainer.loss import LossTerms, fused_draft_loss, reference_draft_loss
    from dflash_trainer.loss.fused import epilogue_kind

    s, dev = ctx.sizes, ctx.device
    n, h, v, c = s.loss_n, s.loss_h, s.loss_v, s.loss_chunk
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hs = torch.randn(n, h, device=dev, generator=g).to(dtype).requires_grad_()
    ht = torch.randn(n, h, device=dev, generator=g).to(dtype)
    head = (torch.randn(v, h, device=dev, generator=g) * 0.02).to(dtype)  # logits of std ~ 0.02 sqrt(H)
    labels = torch.randint(0, v, (n,), device=dev, generator=g)
    weights = torch.ones(n, device=dev, dtype=dtype)
    a = LOSS_TERMS["kl_weight"]
    gemm_kl, gemm_ce = 6 * n * h * v, 4 * n * h * v  # student + teacher logits + G @ W; CE: no teacher

    def fused(compile="auto", **fields):
        terms = LossTerms(**fields)
        teacher = ht if terms.needs_teacher else None  # CE with data labels: no teacher GEMM
        return lambda: fused_draft_loss(hs, teacher, head, labels, weights, terms, chunk_size=c, compile=compile)[0]

    # The chunk epilogue "auto" runs here (Triton on CUDA where triton imports), and the eager passes beside it.
    kernel = epilogue_kind("auto", dev, dtype)
    variants = [
        ("fused CE + 15% KL + CAP", fused(**LOSS_TERMS), gemm_kl),
        ("fused CE + 15% KL", fused(kl_weight=a), gemm_kl),
        ("fused CE", fused(), gemm_ce),
    ]
    if kernel != "eager":
        variants.append(("fused CE + 15% KL + CAP, eager passes", fused(False, **LOSS_TERMS), gemm_kl))
    liger_note = None
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        # beta=0: forward KL(teacher || student), blended as (1-a) CE + a KL like ours (no CAP in Liger).
        jsd = LigerFusedLinearJSDLoss(
            weight_hard_loss=1 - a,
            weight_soft_loss=a,
            beta=0.0,
            temperature=1.0,
            compiled=dev.type == "cuda",  # torch.compile -> Triton on the GPU
            chunk_size=c,
        )
        variants.append(
            ("Liger FusedLinearJSDLoss (CE + 15% KL)", lambda: _as_loss(jsd(hs, head, ht, head, labels)), gemm_kl)
        )
        if dev.type == "cuda":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            lce = LigerFusedLinearCrossEntropyLoss()
            variants.append(
                ("Liger FusedLinearCrossEntropyLoss (CE, Triton)", lambda: _as_loss(lce(head, hs, labels)), gemm_ce)
            )
        else:
            liger_note = "Liger's fused linear cross-entropy is a Triton kernel: CUDA only"
    except ImportError as exc:
        liger_note = f"liger-kernel not installed ({first_line(exc)}): pip install -e '.[bench]'"
    variants.append(
        (
            "reference (full logits) CE + 15% KL + CAP",
            lambda: reference_draft_loss(hs, ht, head, labels, weights, LossTerms(**LOSS_TERMS))[0],
            gemm_kl,
        )
    )

    mm = matmul_flops(c, h, v, dtype, dev)
    rows: list[dict] = []
    result = {
        "shape": {"N": n, "H": h, "V": v, "chunk": c, "dtype": "bfloat16"},
        "matmul_tflops": mm / 1e12,
        "rows": rows,
        "comparisons": [],
        "liger_note": liger_note,
        "kernel": kernel,
    }
    ctx.partial = result
    for name, loss_fn, flops in variants:
        ctx.log(f"  loss: {name}")
        row = {"variant": name}

        def step(loss_fn=loss_fn):
            hs.grad = None
            loss = loss_fn()
            loss.backward()
            return loss.detach().float().item()

        try:
            row["loss"] = step()  # warm-up (and compilation for Liger's compiled path)
            row["time_s"] = median_time(step, dev, s.loss_reps)
            _, row["peak_extra_bytes"] = peak_extra_bytes(step, dev)
            row["gemm_flops"] = flops
            row["gemm_efficiency"] = flops / row["time_s"] / mm
        except Exception as exc:
            row["result"] = "out of memory" if is_oom(exc) else "failed"
            row["error"] = first_line(exc)
        hs.grad = None
        rows.append(row)
        free_memory(dev)

    by = {r["variant"]: r for r in rows}
    comparisons = result["comparisons"]
    for ours, theirs in (
        ("fused CE + 15% KL", "Liger FusedLinearJSDLoss (CE + 15% KL)"),
        ("fused CE", "Liger FusedLinearCrossEntropyLoss (CE, Triton)"),
    ):
        o, t = by.get(ours, {}), by.get(theirs, {})
        if "time_s" in o and "time_s" in t:
            comparisons.append(
                {
                    "ours": ours,
                    "theirs": theirs,
                    "speedup": t["time_s"] / o["time_s"],
                    "memory_ratio": t["peak_extra_bytes"] / max(o["peak_extra_bytes"], 1),
                    "loss_difference": abs(t["loss"] - o["loss"]),
                }
            )
    result["ok"] = all("time_s" in r for r in rows if not r["variant"].startswith("reference"))
    return result


# -- 3. a training step at scale vs the planner ---------------------------------------------------


def section_step(ctx: Context) -> dict:
    """One process holds the target and the drafter (``target_gpus = 0`` in the planner's terms). The
    target is a dense Qwen3 with the seed's hidden size, vocabulary and attention geometry, so the
    drafter (sized from the target's config) is exactly the seed's; the seed's Qwen3.6 target would
    run its Gated DeltaNet layers through transformers' torch fallback here (no fla kernels), which
    measures that fallback rather than this project. One document per row: a packed row would make
    the dense target build an [L, L] mask (the hybrid target runs each document alone anyway)."""
    from planner_measure import allocator_peak
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_trainer.config import load_config
    from dflash_trainer.data.packing import PackedRow
    from dflash_trainer.model.target import TargetModel
    from dflash_trainer.planner.plan import Topology, drafter_device_plan, make_plan
    from dflash_trainer.planner.report import workload_from_config
    from dflash_trainer.planner.shapes import TargetShape
    from dflash_trainer.training.trainer import Trainer

    s, dev = ctx.sizes, ctx.device
    layers = s.step_target["num_hidden_layers"]
    ids = list(range(1, min(6, layers)))  # five feature layers of the six
    cfg = load_config(["ddtree-experiment"], ["drafter.mask_token_id=3", f"target.layer_ids={ids}", *s.step_overrides])
    memory, name = device_memory(dev)
    threads = torch.get_num_threads() if dev.type == "cpu" else 0
    topo = Topology(memory=memory, device_name=name, device=dev.type, allocator_margin=0.0, cpu_threads=threads)
    shape = TargetShape.from_config(s.step_target, "seed-shaped dense target")
    workload = replace(workload_from_config(cfg), packed=s.step_docs > 1)
    plan = make_plan(shape, workload, topo, ids)
    cfg = cfg.model_copy(deep=True)
    cfg.loss.chunk_size = plan.chunk  # what the preflight does: the chunk the planner derives
    ctx.log(f"  step: planner predicts {plan.devices[-1].peak / 1e9:.2f} GB at the {plan.devices[-1].peak_phase} phase")

    t0 = time.perf_counter()
    fields = {k: v for k, v in s.step_target.items() if k != "model_type"}
    tc = Qwen3Config(**fields, tie_word_embeddings=False, max_position_embeddings=cfg.data.seq_len)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(tc)
    model = model.to(getattr(torch, cfg.target.dtype)).eval()
    target = TargetModel(model, layer_ids=ids, num_feature_layers=len(ids))
    length = cfg.data.seq_len
    g = torch.Generator().manual_seed(0)
    sizes = [length // s.step_docs] * (s.step_docs - 1)
    sizes.append(length - sum(sizes))
    row = PackedRow(
        torch.randint(4, shape.vocab_size, (length,), generator=g),
        torch.cat([torch.arange(k) for k in sizes]),
        torch.ones(length, dtype=torch.long),
    )
    out_dir = tempfile.mkdtemp(prefix="dflash-gpu-check-")
    trainer = Trainer(cfg, target, None, [row], [], out_dir=out_dir, target_path=None, progress=False)
    params = sum(p.numel() for p in trainer.drafter.parameters())
    result = {
        "config": {
            "preset": "ddtree-experiment",
            "overrides": list(s.step_overrides),
            "seq_len": length,
            "documents": s.step_docs,
            "anchors_x_block": f"{cfg.data.max_anchors} x {cfg.drafter.block_size}",
            "attention_backend": cfg.drafter.attention_backend,
            "activation_checkpointing": cfg.drafter.activation_checkpointing,
            "loss_chunk": plan.chunk,
            "target": s.step_target,
            "target_layer_ids": ids,
            "drafter_params": params,
        },
        "setup_s": time.perf_counter() - t0,
    }
    ctx.partial = result
    ctx.log(
        f"  step: target + {params / 1e6:,.1f} M-parameter drafter built in {result['setup_s']:.0f} s; warm-up step"
    )

    t0 = time.perf_counter()
    first = trainer.train_step()  # compiles flex (forward, backward) and creates AdamW's states
    sync(dev)
    result["warmup_step_s"] = time.perf_counter() - t0

    # Timed steps first: speed and the whole step's peak, whatever the per-phase measurements do.
    ctx.log(f"  step: {s.step_timed} timed steps")
    measured: dict = {}
    result["measured"] = measured
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(s.step_timed):
        last = trainer.train_step()
    sync(dev)
    step_s = (time.perf_counter() - t0) / s.step_timed
    result.update(
        step_s=step_s,
        steps_per_s=1 / step_s,
        tokens_per_s=length / step_s,
        positions_per_s=cfg.data.max_anchors * cfg.drafter.block_size / step_s,
        last_loss=last["loss"] if last else None,
    )
    if dev.type == "cuda":
        measured["max_memory_allocated_timed_steps"] = torch.cuda.max_memory_allocated(dev)
        ctx.log("  step: one step with torch.cuda.max_memory_allocated per phase")
        try:
            trainer.zero_grad()
            free_memory(dev)
            with cuda_phase_peaks(dev, {}) as peaks:
                trainer.train_step()
            measured["cuda_phases"] = {k: v for k, v in peaks.items() if k != "step"}
            measured["max_memory_allocated_phased_step"] = peaks["step"]
        except Exception as exc:  # the allocator events below still measure the phases
            measured["cuda_phases_error"] = first_line(exc)

    ctx.log("  step: profiled step (allocator events per phase)")
    trainer.zero_grad()
    free_memory(dev)
    start = allocated_now(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        out, extra, phases = allocator_peak(trainer.train_step, dev.type)
        sync(dev)
        measured.update(start=start, peak=start + extra, phases={k: start + v for k, v in phases.items()})
        if dev.type == "cuda":
            measured["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
    except Exception as exc:
        if not measured.get("cuda_phases"):
            raise
        out, measured["phases"], measured["allocator_events_error"] = last, {}, first_line(exc)

    accuracy = (out or last or first or {}).get("accuracy", 0.0)
    predicted = drafter_device_plan(shape, workload, topo, ids, plan.chunk, correct_fraction=accuracy)
    # On CUDA the comparison uses torch.cuda.max_memory_allocated per phase (the allocator-event
    # figures are kept next to it); on the CPU, the allocator events.
    by_phase = measured.get("cuda_phases") or measured["phases"]
    compare = []
    for phase, pred in predicted.phases.items():
        got = by_phase.get(phase)
        compare.append(
            {
                "phase": phase,
                "predicted": pred,
                "measured": got,
                "measured_allocator_events": measured["phases"].get(phase),
                "ratio": got / pred if got else None,
                "within_10pct": bool(got and abs(got / pred - 1) <= 0.10),
            }
        )
    overall = measured.get("max_memory_allocated_phased_step") or measured["peak"]
    del trainer, target, model
    free_memory(dev)
    result.update(
        accuracy=accuracy,
        predicted_peak=predicted.peak,
        predicted_peak_phase=predicted.peak_phase,
        phases=compare,
        measured_peak=overall,
        peak_within_10pct=abs(overall / predicted.peak - 1) <= 0.10,
        ok=True,
    )
    return result


# -- 4. speculative decoding on the device --------------------------------------------------------


def section_speculative(ctx: Context) -> dict:
    from dflash_trainer.config import load_config
    from dflash_trainer.data.records import iter_records
    from dflash_trainer.inference.regenerate import regenerate_records
    from dflash_trainer.inference.speculative import SpeculativeDecoder, target_greedy
    from dflash_trainer.tiny_target.corpus import load_split
    from dflash_trainer.training.setup import prepare
    from dflash_trainer.training.trainer import Trainer

    s, dev = ctx.sizes, ctx.device
    root = Path(tempfile.mkdtemp(prefix="dflash-gpu-check-spec-"))
    prompts = []
    for f in load_split("held_out", limit=s.spec_train_prompts + s.spec_eval_prompts):
        head = "".join(f.text.splitlines(keepends=True)[:8])
        prompts.append(
            {
                "messages": [
                    {"role": "user", "content": f"Continue the Python module `{f.relpath}`:\n{head}"},
                    {"role": "assistant", "content": ""},
                ]
            }
        )
    eval_prompts, train_prompts = prompts[: s.spec_eval_prompts], prompts[s.spec_eval_prompts :]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_prompts))
    base = ["tiny-demo"]
    cfg = load_config(
        base,
        [
            f"data.train_files=[{root / 'train.jsonl'}]",
            f"output_dir={root / 'run'}",
            f"train.max_steps={s.spec_train_steps}",
            "train.lr=3e-3",
            "data.max_eval_rows=1",
        ],
    )
    # prepare() loads the target on the CPU; it moves to the device before anything runs on it.
    from dflash_trainer.model.loading import load_target

    model, tok, _ = load_target(cfg.target)
    model.to(dev)
    t0 = time.perf_counter()
    records = list(iter_records([str(root / "prompts.jsonl")]))
    generated = list(
        regenerate_records(records, model, tok, max_new_tokens=s.spec_gen_tokens, batch_size=16, progress=False)
    )
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generated))
    regen_s = time.perf_counter() - t0
    del model
    target, tok, rows, eval_rows, _ = prepare(cfg)
    target.model.to(dev)
    ctx.log(
        f"  speculative: {len(generated)} responses regenerated in {regen_s:.1f} s; training {s.spec_train_steps} steps on {len(rows)} rows"
    )
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=root / "run", target_path="tiny", progress=False)
    t0 = time.perf_counter()
    for _ in range(s.spec_train_steps):
        trainer.train_step()
    sync(dev)
    train_s = time.perf_counter() - t0
    drafter = trainer.drafter.eval()
    eos = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")} - {None})
    decoder = SpeculativeDecoder(target, drafter, eos)
    prompt_ids = []
    for r in eval_prompts:
        ids = tok.apply_chat_template(r["messages"][:1], tokenize=True, add_generation_prompt=True)
        prompt_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))

    # warm-up: kernels and caches for both paths on the device
    target_greedy(target.model, prompt_ids[0], 8, eos)
    decoder.generate(prompt_ids[0], 8, "chain")
    ref_tokens, ref_s = [], 0.0
    for ids in prompt_ids:
        toks, sec = target_greedy(target.model, ids, s.spec_decode_tokens, eos)
        ref_tokens.append(toks)
        ref_s += sec
    n_ref = sum(len(t) for t in ref_tokens)
    rows_out = [{"mode": "target only (greedy)", "tokens": n_ref, "tokens_per_s": n_ref / ref_s, "lossless": True}]
    result = {
        "prompts": {"train": len(train_prompts), "eval": len(eval_prompts)},
        "regenerate_s": regen_s,
        "train_steps": s.spec_train_steps,
        "train_s": train_s,
        "rows": rows_out,
    }
    ctx.partial = result
    modes = [("chain", 1)] + [("ddtree", b) for b in s.spec_budgets]
    for mode, budget in modes:
        label = "chain" if mode == "chain" else f"DDTree {budget}"
        ctx.log(f"  speculative: {label}")
        same, accepted, rounds, sec, n_tok = True, 0, 0, 0.0, 0
        for ids, ref in zip(prompt_ids, ref_tokens):
            res = decoder.generate(ids, s.spec_decode_tokens, mode, budget=budget)
            same &= res.tokens == ref
            accepted += sum(res.accepted)
            rounds += len(res.accepted)
            sec += res.seconds
            n_tok += len(res.tokens)
        rows_out.append(
            {
                "mode": label,
                "tokens": n_tok,
                "tokens_per_s": n_tok / sec,
                "tau": (accepted + rounds) / max(1, rounds),
                "speedup": (n_tok / sec) / (n_ref / ref_s),
                "lossless": bool(same),
            }
        )
    result["ok"] = all(r["lossless"] for r in rows_out)
    return result


RUNNERS = {
    "attention": section_attention,
    "loss": section_loss,
    "step": section_step,
    "speculative": section_speculative,
}


# -- report -------------------------------------------------------------------------------------


def _gb(b) -> str:
    """Decimal GB, three significant digits (the --small run's megabytes stay readable)."""
    return "-" if b is None else f"{b / 1e9:.3g}"


def _e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _version(module: str) -> str | None:
    """The installed version of ``module``'s distribution, or None where it does not import."""
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001 - a broken install is as good as none for this report
        return None
    return str(getattr(mod, "__version__", "installed"))


def fast_paths(device: torch.device) -> dict:
    """Which optional fast paths this machine has (the [gpu] extra) and which ones a run takes: the loss's
    chunk epilogue for a bf16 head of the seed's shape, and the functions transformers' hybrid
    (Gated DeltaNet) layers resolved at import: flash-linear-attention / causal-conv1d kernels or its
    torch loops."""
    from dflash_trainer.loss.fused import epilogue_kind

    found = {name: _version(module) for name, module in FAST_PATH_PACKAGES.items()}
    used = {"loss chunk epilogue (bf16 head)": epilogue_kind("auto", device, torch.bfloat16)}
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hybrid

        for what, fn in (
            ("hybrid layers: gated delta rule", hybrid.torch_chunk_gated_delta_rule),
            ("hybrid layers: short convolution", hybrid.causal_conv1d_fn),
        ):
            module = getattr(fn, "__module__", "") or ""
            used[what] = module.split(".")[0] if not module.startswith("transformers") else "torch fallback"
    except (ImportError, AttributeError) as exc:
        used["hybrid layers"] = f"not inspected ({first_line(exc)})"
    return {"found": found, "used": used}


# Package (as pip names it) -> module, for the fast-path report.
FAST_PATH_PACKAGES = {
    "triton": "triton",
    "flash-linear-attention": "fla",
    "causal-conv1d": "causal_conv1d",
    "liger-kernel": "liger_kernel",
}


def render(results: dict) -> str:
    m = results["meta"]
    lines = [
        f"# GPU check ({m['date']}, {m['device_name']}, torch {m['torch']}{', --small' if m['small'] else ''})",
        "",
        f"`{m['command']}`; {m['elapsed_s']:.0f} s in all. GB = 1e9 bytes.",
        "",
    ]
    if "fast_paths" in m:
        fp = m["fast_paths"]
        found = ", ".join(f"{k} {v or 'not installed'}" for k, v in fp["found"].items())
        used = ", ".join(f"{k}: {v}" for k, v in fp["used"].items())
        lines += [f"Fast paths found: {found}. Used: {used}.", ""]
    for name in SECTIONS:
        sec = results["sections"].get(name)
        if sec is None:
            continue
        lines += [f"## {name}", ""]
        status = sec["status"]
        if status != "ok":
            lines += [f"**{status}**: {sec.get('error', '')}", ""]
            if "traceback" in sec:
                lines += ["```", sec["traceback"].rstrip(), "```", ""]
        if "result" in sec:
            try:
                lines += RENDERERS[name](sec["result"]) + [""]
            except (KeyError, TypeError):  # a partial result the table cannot show: the raw record
                lines += ["```", json.dumps(sec["result"], indent=1, default=str)[:4000], "```", ""]
        lines += [f"({sec['seconds']:.1f} s)", ""]
    return "\n".join(lines)


def _render_attention(r: dict) -> list[str]:
    sh = r["shape"]
    out = [
        f"Row of {sh['row_tokens']} tokens in documents {sh['documents']}, {sh['blocks']} blocks ({sh['queries']} "
        f"queries), hidden {sh['hidden']}, heads {sh['heads']}, window {sh['window']}. Relative max-abs "
        "differences (max |a - b| / max |b|); gradients: the worst parameter. Pass: flex's error against the "
        "float64 dense reference is at most twice the dense backend's plus a small slack.",
        "",
        "| layers | dtype | fwd flex vs dense | fwd dense vs fp64 | fwd flex vs fp64 | grad flex vs dense | grad dense vs fp64 | grad flex vs fp64 | pass |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        if "error" in row:
            out.append(f"| {row['layers']} | {row['dtype']} | {row['error']} | | | | | | no |")
            continue
        if "fp64_reference_error" in row:
            out.append(
                f"| {row['layers']} | {row['dtype']} | (float64 reference failed: {row['fp64_reference_error']}) | | | | | | |"
            )
        grads = [
            _e(row["grad_flex_vs_dense"]) if "grad_flex_vs_dense" in row else row.get("grad", "-"),
            _e(row.get("grad_dense_vs_fp64")),
            _e(row.get("grad_flex_vs_fp64")) if "grad_flex_vs_dense" in row else "-",
        ]
        cells = [
            row["layers"],
            row["dtype"],
            _e(row["fwd_flex_vs_dense"]),
            _e(row.get("fwd_dense_vs_fp64")),
            _e(row.get("fwd_flex_vs_fp64")),
            *grads,
            "yes" if row["pass"] else "no",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _render_loss(r: dict) -> list[str]:
    sh = r["shape"]
    out = [
        f"N = {sh['N']:,}, H = {sh['H']:,}, V = {sh['V']:,}, {sh['dtype']} head and hidden states, chunk "
        f"{sh['chunk']} rows; forward + backward, median of the timed runs after a warm-up; peak = allocated "
        f"above the inputs. GEMM efficiency = GEMM FLOPs / time / {r['matmul_tflops']:.3g} TFLOP/s (measured "
        "bf16 matmul of the chunk's shape).",
        "",
        f"The fused rows' chunk epilogue: {r.get('kernel', '?')} (what compile='auto' chose here).",
        "",
        "| variant | fwd+bwd s | peak extra GB | GEMM eff. | loss | result |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        if "time_s" in row:
            out.append(
                f"| {row['variant']} | {row['time_s']:.3f} | {_gb(row['peak_extra_bytes'])} | "
                f"{row['gemm_efficiency']:.0%} | {row['loss']:.4f} | ok |"
            )
        else:
            out.append(f"| {row['variant']} | - | - | - | - | {row['result']}: {row['error']} |")
    if r.get("liger_note"):
        out += ["", f"Liger: {r['liger_note']}."]
    if any(row["variant"].startswith("Liger FusedLinearJSD") for row in r["rows"]):
        out += [
            "",
            "Liger's chunked distillation loss always computes the head's gradient too (one more GEMM per chunk "
            "and a [V, H] buffer), even for a frozen head; its GEMM efficiency counts only the 6NHV both need.",
        ]
    for c in r["comparisons"]:
        out += [
            "",
            f"- {c['ours']} vs {c['theirs']}: {c['speedup']:.2f}x the speed, {c['memory_ratio']:.2f}x less memory "
            f"(ratio of peaks), loss values differ by {c['loss_difference']:.2e}.",
        ]
    return out


def _render_step(r: dict) -> list[str]:
    c, m = r["config"], r["measured"]
    out = [
        f"ddtree-experiment preset{' with ' + ', '.join(c['overrides']) if c['overrides'] else ''}: row of "
        f"{c['seq_len']:,} tokens ({c['documents']} document), {c['anchors_x_block']} blocks, {c['attention_backend']} "
        f"attention, checkpointing {c['activation_checkpointing']}, loss chunk {c['loss_chunk']} (planner-derived); "
        f"target: random-init {c['target']['num_hidden_layers']}-layer Qwen3, hidden {c['target']['hidden_size']}, "
        f"vocabulary {c['target']['vocab_size']:,}, layer ids {c['target_layer_ids']}; drafter "
        f"{c['drafter_params'] / 1e6:,.1f} M parameters.",
        "",
        f"- {r['steps_per_s']:.3f} steps/s ({r['step_s']:.2f} s per step), {r['tokens_per_s']:,.0f} row tokens/s, "
        f"{r['positions_per_s']:,.0f} trained positions/s; warm-up step (compilation) {r['warmup_step_s']:.1f} s.",
        f"- peak allocated in a step: {_gb(r['measured_peak'])} GB measured; planner {_gb(r['predicted_peak'])} GB at "
        f"the {r['predicted_peak_phase']} phase ({'within' if r['peak_within_10pct'] else 'NOT within'} 10%). "
        f"Allocator events of the profiled step: {_gb(m.get('peak'))} GB"
        + (
            f"; torch.cuda.max_memory_allocated of that step {_gb(m['max_memory_allocated'])} GB"
            if "max_memory_allocated" in m
            else ""
        )
        + (
            f"; of the timed steps {_gb(m['max_memory_allocated_timed_steps'])} GB"
            if "max_memory_allocated_timed_steps" in m
            else ""
        )
        + ".",
    ]
    if "cuda_phases_error" in m:
        out.append(f"- per-phase torch.cuda.max_memory_allocated failed: {m['cuda_phases_error']}")
    if "allocator_events_error" in m:
        out.append(f"- the profiled step (allocator events) failed: {m['allocator_events_error']}")
    source = "torch.cuda.max_memory_allocated" if m.get("cuda_phases") else "allocator events"
    out += [
        "",
        f"| phase | predicted GB | measured GB ({source}) | allocator events GB | measured / predicted | within 10% |",
        "|---|---|---|---|---|---|",
    ]
    for p in r["phases"]:
        ratio = "-" if p["ratio"] is None else f"{p['ratio']:.3f}"
        out.append(
            f"| {p['phase']} | {_gb(p['predicted'])} | {_gb(p['measured'])} | {_gb(p['measured_allocator_events'])} | "
            f"{ratio} | {'yes' if p['within_10pct'] else 'no'} |"
        )
    return out


def _render_speculative(r: dict) -> list[str]:
    out = [
        f"Embedded tiny target; a drafter trained {r['train_steps']} steps ({r['train_s']:.1f} s) on the target's "
        f"greedy continuations of {r['prompts']['train']} held-out prompts; decoding {r['prompts']['eval']} other prompts.",
        "",
        "| mode | tokens | tokens/s | tau | speedup | identical to target greedy |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        tau = f"{row['tau']:.2f}" if "tau" in row else "-"
        speed = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        out.append(
            f"| {row['mode']} | {row['tokens']} | {row['tokens_per_s']:.0f} | {tau} | {speed} | {'yes' if row['lossless'] else 'NO'} |"
        )
    return out


RENDERERS = {
    "attention": _render_attention,
    "loss": _render_loss,
    "step": _render_step,
    "speculative": _render_speculative,
}


# -- driver -------------------------------------------------------------------------------------


def _on_alarm(_signum, _frame):
    raise SectionTimeout("section time limit reached")


def write_results(results: dict, out: Path) -> None:
    from dflash_trainer.io import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "gpu.json", json.dumps(results, indent=2, default=str) + "\n")
    atomic_write_text(out / "gpu.md", render(results))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or auto (cuda when available)")
    p.add_argument("--small", action="store_true", help="toy sizes: seconds on a CPU (the test suite runs this)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu.md and gpu.json")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for all sections together")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        print(f"gpu_check: unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: --device cuda but torch sees no CUDA device (is this a CPU-only torch build?)", file=sys.stderr
        )
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu" and not args.small:
        print("gpu_check: note: the full sizes on a CPU take hours; use --small for the CPU smoke run", flush=True)
    sizes = small_sizes() if args.small else gpu_sizes()
    t_start = time.time()
    deadline = t_start + args.budget

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    ctx = Context(device=device, sizes=sizes, small=args.small, log=log)
    results = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": str(device),
            "device_name": device_memory(device)[1] if device.type == "cuda" else platform.processor() or "CPU",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "small": args.small,
            "sections": sections,
            "budget_s": args.budget,
            "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "elapsed_s": 0.0,
            "fast_paths": fast_paths(device),
        },
        "sections": {},
    }
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for sec in sections:
            left = deadline - time.time()
            cap = SECTION_CAPS[sec] * sizes.budget_scale
            limit = int(min(cap, left))
            if limit < 5:
                results["sections"][sec] = {"status": "skipped", "error": "time budget spent", "seconds": 0.0}
                log(f"{sec}: skipped (time budget spent)")
                continue
            log(f"{sec}: start (limit {limit} s)")
            t0 = time.time()
            entry: dict = {}
            ctx.partial = {}
            fresh_compile_caches()
            signal.alarm(limit)
            try:
                result = RUNNERS[sec](ctx)
                entry = {"status": "ok" if result.get("ok", True) else "checks failed", "result": result}
            except BaseException as exc:  # noqa: BLE001 - a section's failure is its result
                if isinstance(exc, KeyboardInterrupt):
                    raise
                entry = {
                    "status": "timed out" if isinstance(exc, SectionTimeout) else "failed",
                    "error": first_line(exc),
                    "traceback": "".join(traceback.format_exception(exc)[-6:]),
                }
                if ctx.partial:
                    entry["result"] = ctx.partial
            finally:
                signal.alarm(0)
            entry["seconds"] = time.time() - t0
            results["sections"][sec] = entry
            results["meta"]["elapsed_s"] = time.time() - t_start
            free_memory(device)
            write_results(results, args.out)
            log(f"{sec}: {entry['status']}" + (f" ({entry['error']})" if "error" in entry else ""))
    finally:
        signal.signal(signal.SIGALRM, old)
    results["meta"]["elapsed_s"] = time.time() - t_start
    write_results(results, args.out)
    log(f"wrote {args.out / 'gpu.md'} and {args.out / 'gpu.json'}")
    return 0 if all(e["status"] == "ok" for e in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
