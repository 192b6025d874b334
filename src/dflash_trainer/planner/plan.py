"""Assemble the formulas into a per-device plan: what is alive in each phase of a step, the peak, the verdict.

A drafter device goes through these phases every step (``Trainer.train_step``), and the peak is the
largest of them:

    rollout          (train.stage=on_policy) the target decoding a prompt with the drafter: its KV
                     cache, one verification pass (a chain's block or a DDTree), the recorded teacher
                     rows (``rollout_items``)
    target forward   (only when the target shares the device) weights + body-only forward temporaries
    drafter forward  features, masks, activations saved so far, the layer's temporaries
    loss             saved activations, drafter output, loss inputs, fused-loss workspace
    backward         saved activations shrinking layer by layer while gradients appear
    optimizer        parameters, gradients, AdamW states and the step's temporaries

A target device holds the target's weights and one body-only forward over a packed row. On CUDA a
fixed runtime reserve (context, cuBLAS/NCCL workspaces) and an allocator margin (fragmentation of
PyTorch's caching allocator, a share of the tensor peak) are added before the comparison with the
device's memory. Everything is a prediction from formulas; on a GPU nothing here was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..loss.fused import planned_epilogue
from ..precision import muon_ns_dtype
from . import formulas as F
from .shapes import GB, TargetShape, target_param_count

CUDA_RUNTIME_BYTES = int(1.5 * GB)  # CUDA context, cuBLAS and NCCL workspaces: a typical reserve per GPU
DEFAULT_ALLOCATOR_MARGIN = 0.05
MAX_DERIVED_CHUNK = 1024  # rows per loss chunk when derived: [1024, H] x [H, V] GEMMs already fill a GPU


@dataclass(frozen=True)
class Topology:
    """Where the pieces run. ``target_gpus == 0``: the target shares the drafter's device (what
    ``dflash-train train`` does today, in one process)."""

    memory: int  # bytes per device
    device_name: str
    device: str = "cuda"  # "cuda" or "cpu": selects kernel paths (attention, optimizer) and the runtime reserve
    target_gpus: int = 0
    drafter_gpus: int = 1
    allocator_margin: float = DEFAULT_ALLOCATOR_MARGIN
    cpu_threads: int = 0  # intra-op threads of a CPU run (per-thread attention workspaces); 0 on GPUs
    offline: bool = False  # data.features: the drafter reads cached features, no target body anywhere

    @property
    def threads(self) -> int:
        return self.cpu_threads if self.device == "cpu" else 0


@dataclass
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class DevicePlan:
    """One kind of device: its items (each at the size it has in the peak phase, or at its largest if it
    is not alive then), the phase totals, the peak and the verdict."""

    role: str
    count: int
    capacity: int
    device_name: str
    items: list[Item]
    phases: dict[str, int]
    peak_phase: str
    peak: int  # tensors only
    runtime: int
    margin: int
    in_peak: set[str] = field(default_factory=set)

    @property
    def total(self) -> int:
        return self.peak + self.runtime + self.margin

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def headroom(self) -> int:
        return self.capacity - self.total


@dataclass
class Plan:
    target: TargetShape
    workload: F.Workload
    topology: Topology
    devices: list[DevicePlan]
    chunk: int
    chunk_source: str
    naive: bool = False
    recommendations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    throughput: dict | None = None  # planner.throughput: as launched and the best split (GPU presets only)
    data: dict | None = None  # the prepared data's disk and RAM cost (report.data_cost)
    capture: dict | None = None  # the feature cache's disk and RAM cost (report.capture_cost)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)


def _margin(peak: int, topo: Topology) -> int:
    return int(peak * topo.allocator_margin)


def _runtime(topo: Topology) -> int:
    return CUDA_RUNTIME_BYTES if topo.device == "cuda" else 0


def _target_layer_ids(s: TargetShape, w: F.Workload, layer_ids: list[int] | None) -> list[int]:
    if layer_ids:
        return list(layer_ids)
    from ..model.target import default_layer_ids

    return default_layer_ids(s.num_layers, w.num_features)


def _device(
    role, count, topo, phases: dict[str, dict[str, int]], order: list[str], notes: dict[str, str]
) -> DevicePlan:
    totals = {p: sum(v.values()) for p, v in phases.items()}
    peak_phase = max(totals, key=lambda p: totals[p])
    live = phases[peak_phase]
    largest: dict[str, int] = {}
    for v in phases.values():
        for k, b in v.items():
            largest[k] = max(largest.get(k, 0), b)
    items = [Item(k, live.get(k, largest.get(k, 0)), notes.get(k, "")) for k in order if largest.get(k, 0)]
    peak = totals[peak_phase]
    return DevicePlan(
        role=role,
        count=count,
        capacity=topo.memory,
        device_name=topo.device_name,
        items=items,
        phases=totals,
        peak_phase=peak_phase,
        peak=peak,
        runtime=_runtime(topo),
        margin=_margin(peak, topo),
        in_peak={k for k, b in live.items() if b},
    )


def target_phases(
    s: TargetShape, w: F.Workload, layer_ids: list[int], naive: bool, cpu_threads: int = 0, body_only: bool = False
) -> dict[str, int]:
    """The target forward's items. ``body_only``: the weights of a target rank, which drops the output head
    (``TargetModel.keep_only("body")``; a tied head is the embedding and stays)."""
    fwd = F.target_forward_peak(s, w, layer_ids, cpu_threads)
    out = {
        "target weights": F.target_weight_bytes(target_param_count(s) - (_untied_head(s) if body_only else 0), w),
        "target activations (body-only forward)": fwd["activations"],
        "captured hidden states": fwd["captured"],
        "attention mask (packed rows, sdpa)": fwd["mask"],
    }
    if naive:
        out.update(F.naive_target_extra(s, w))
    return out


def optimizer_states(w: F.Workload, d: F.DrafterDims, params: int, tensors: int) -> dict[str, int]:
    """The optimizer states' item: AdamW's two fp32 states, or Muon's one on the hidden matrices."""
    if w.optimizer == "muon":
        return {
            "optimizer states (Muon + AdamW, fp32)": F.muon_state_bytes(params, tensors, F.muon_matrix_shapes(w, d))
        }
    return {"optimizer states (AdamW, fp32)": F.optimizer_state_bytes(params, tensors)}


def drafter_phases(
    s: TargetShape,
    w: F.Workload,
    topo: Topology,
    layer_ids: list[int],
    chunk: int,
    naive: bool = False,
    correct_fraction: float = 1.0,
) -> dict[str, dict[str, int]]:
    """Per phase, the bytes of every item alive in it (see the module docstring)."""
    d = F.DrafterDims.of(s, w.drafter_intermediate)
    dev = topo.device
    colocated = topo.target_gpus == 0 and not topo.offline
    L, Q, h = w.seq_len, w.queries, d.hidden
    head_params, head_tensors, _ = F.variant_head_params(w, d)
    params = F.drafter_param_count(d, w.drafter_layers, w.num_features) + head_params
    tensors = F.drafter_param_tensors(w.drafter_layers) + head_tensors
    grads = 4 * params
    static = {
        "target weights" if colocated else "target embedding + lm_head (frozen)": F.target_weight_bytes(
            target_param_count(s), w
        )
        if colocated
        else F.target_head_and_embedding_bytes(s, w),
        "drafter weights (fp32)": 4 * params,
        **optimizer_states(w, d, params, tensors),
        "packed row, anchors, blocks": 8 * (4 * L + 8 * Q),
    }
    if w.grad_accum > 1:
        static["gradients (fp32)"] = grads
    if topo.drafter_gpus > 1:
        static["DDP gradient buckets"] = grads
    feats = F.captured_features_bytes(s, w)
    feats_name = (
        "captured hidden states"
        if colocated
        else "features read from the cache"
        if topo.offline
        else "context features (received)"
    )
    features = {feats_name: feats}
    if topo.target_gpus:  # the next row arrives from a target GPU while this one trains
        static["next row's features (in flight)"] = w.prefetch * feats
    # Features the autograd graph keeps after row_forward returns: fc's input is the caller's own fp32
    # context tensor when no copy was needed.
    retained = L * w.num_features * h * 4 if (not w.autocast and w.t == 4 and not w.noise) else 0

    stem = F.stem_saved(d, w)
    layers = [F.layer_saved(d, w, dev, first=(i == 0)) for i in range(w.drafter_layers)]
    full = [sum(v.values()) for v in layers]
    copies = [v.get("bf16 weight copies", 0) for v in layers]
    if w.activation_checkpointing:  # a checkpointed layer keeps only its output (the next one's input)
        kept = [Q * h * 4 for _ in layers]
    else:
        kept = full
    stem_b = sum(stem.values())
    final = F._norm_saved(Q, h, 4, True)
    out_b = Q * h * 4
    ctx_alive = 0 if (not w.autocast or w.activation_checkpointing) else L * h * 4  # the fp32 context rows
    fc_cast = w.num_features * h * h * 2 if w.autocast else 0  # autocast's cache holds fc's bf16 weight
    masks = F.attention_mask_bytes(d, w)
    mask_name = "attention masks (dense [Q, L+Q])" if w.attention_backend == "dense" else "attention block masks (flex)"
    act_name = "drafter activations (saved for backward)"
    tmp_name = "temporaries (largest step)"

    phases: dict[str, dict[str, int]] = {}
    if colocated and w.rollout_tokens:  # train.stage=on_policy: the rollout before the step
        phases["rollout"] = {**static, **F.rollout_items(s, w)}
    if colocated:
        phases["target forward"] = {
            **static,
            **{k: v for k, v in target_phases(s, w, layer_ids, False, topo.threads).items() if k != "target weights"},
        }
    # drafter forward: the stem, then layer by layer (the peak is at the last layer unless the stem's
    # temporaries dominate).
    base_fwd = {**static, **features, mask_name: masks}
    best = dict(base_fwd, **{tmp_name: max(F.stem_forward_transient(d, w), F.mask_build_transient(w))})
    cum = stem_b + ctx_alive
    lt = F.layer_forward_transient(d, w, dev, topo.threads)
    for i in range(w.drafter_layers):
        cum += kept[i]
        ckpt_extra = F.checkpointed_layer_forward(d, w) if w.activation_checkpointing else 0
        cand = dict(
            base_fwd,
            **{
                act_name: cum + (sum(copies[: i + 1]) if w.activation_checkpointing else 0) + fc_cast,
                tmp_name: lt + ckpt_extra,
            },
        )
        if sum(cand.values()) > sum(best.values()):
            best = cand
    phases["drafter forward"] = best

    saved_all = stem_b + sum(kept) + final + out_b
    if w.activation_checkpointing:  # checkpoint inputs: the masks and the first layer's (no-grad) input
        saved_all += masks + Q * h * 4
    loss_ws = F.loss_workspace(w, d.vocab, h, chunk, correct_fraction, loss_kernel(w, topo, d.vocab))
    loss = {
        **static,
        act_name: saved_all,
        "loss inputs (hidden cast, teacher rows)": F.loss_inputs_bytes(w, h),
        "fused loss workspace": sum(loss_ws.values()),
    }
    loss.update(F.variant_loss_items(w, d))
    if retained:
        loss["context features (kept by the graph)"] = retained
    phases["loss"] = loss

    # backward: loss backward, then the layers from last to first (recomputed when checkpointed).
    bwd_base = {**static, **({"context features (kept by the graph)": retained} if retained else {})}
    grad_layers = [4 * (F.drafter_layer_params(d) + F.variant_layer_params(w, d))] * w.drafter_layers
    start = dict(
        bwd_base, **{act_name: saved_all, "fused loss workspace": loss_ws["dh"], tmp_name: F.loss_backward_bytes(w, h)}
    )
    best = start
    g_so_far = 4 * h if w.grad_accum == 1 else 0  # the final norm's weight gradient
    ckpt_inputs = (masks + Q * h * 4) if w.activation_checkpointing else 0
    for j in reversed(range(w.drafter_layers)):
        below = stem_b + sum(kept[:j]) + ckpt_inputs  # a checkpointed layer is recomputed in full first
        own = F.layer_backward_peak(d, w, layers[j], j < w.drafter_layers - 1, topo.threads)
        g_here = g_so_far + grad_layers[j]
        cand = dict(
            bwd_base, **{act_name: below, tmp_name: own, "gradients (fp32)": g_here if w.grad_accum == 1 else grads}
        )
        if sum(cand.values()) > sum(best.values()):
            best = cand
        g_so_far = g_here
    stem_bwd = dict(
        bwd_base,
        **{
            act_name: stem_b,
            "gradients (fp32)": grads,
            tmp_name: L * h * 4 + L * h * w.c + w.num_features * h * h * (w.c + 4),
        },
    )
    if sum(stem_bwd.values()) > sum(best.values()):
        best = stem_bwd
    phases["backward"] = best

    largest = max(F.drafter_largest_param(d, w.num_features), F.variant_head_params(w, d)[2])
    step_tmp = F.optimizer_step_transient(params, largest, dev)
    if w.optimizer == "muon":  # AdamW's step on the rest, then Muon's, one matrix at a time
        matrices = F.muon_matrix_shapes(w, d)
        rest = params - sum(a * b for a, b in matrices)
        step_tmp = max(
            F.optimizer_step_transient(rest, F.muon_rest_largest(w, d), dev),
            F.muon_step_transient(matrices, dev, muon_ns_dtype(dev).itemsize),
        )
    phases["optimizer"] = {**static, "gradients (fp32)": grads, tmp_name: step_tmp}
    if naive:  # the loss on materialized [N, V] tensors replaces the fused loss
        for name in ("fused loss workspace", "loss inputs (hidden cast, teacher rows)"):
            phases["loss"].pop(name, None)
        phases["loss"].update(F.naive_drafter_extra(s, w))
    return phases


_DRAFTER_ORDER = [
    "target weights",
    "target embedding + lm_head (frozen)",
    "target activations (body-only forward)",
    "captured hidden states",
    "attention mask (packed rows, sdpa)",
    "rollout KV cache (target)",
    "rollout verification pass",
    "rollout tree mask",
    "rollout teacher rows",
    "rollout drafter context (keys, values)",
    "context features (received)",
    "features read from the cache",
    "next row's features (in flight)",
    "context features (kept by the graph)",
    "drafter weights (fp32)",
    "gradients (fp32)",
    "DDP gradient buckets",
    "optimizer states (AdamW, fp32)",
    "optimizer states (Muon + AdamW, fp32)",
    "drafter activations (saved for backward)",
    "attention masks (dense [Q, L+Q])",
    "attention block masks (flex)",
    "loss inputs (hidden cast, teacher rows)",
    "fused loss workspace",
    "temporaries (largest step)",
    "packed row, anchors, blocks",
]
_NOTES = {
    "drafter activations (saved for backward)": "",
    "fused loss workspace": "",
    "next row's features (in flight)": "topology.prefetch rows received ahead while this one trains",
    "attention mask (packed rows, sdpa)": "bool [L, L]; each layer converts it to [L, L] in the target dtype",
}


def _forward_note(s: TargetShape, w: F.Workload, layer_ids: list[int]) -> str:
    where = (
        f"all {s.num_layers} layers + final norm (teacher states needed)"
        if w.need_teacher_layers
        else f"early exit after layer {max(layer_ids)} of {s.num_layers}"
    )
    doc = "" if s.packs_documents else ", one document at a time (linear attention; torch fallback priced)"
    return f"body only, no lm_head; {where}{doc}"


def drafter_device_plan(s, w, topo, layer_ids, chunk, naive=False, correct_fraction=1.0) -> DevicePlan:
    phases = drafter_phases(s, w, topo, layer_ids, chunk, naive, correct_fraction)
    order = list(_DRAFTER_ORDER)
    for v in phases.values():
        order += [k for k in v if k not in order]
    where = "device" if topo.device == "cuda" else "CPU"
    role = (
        "drafter GPU"
        if topo.target_gpus
        else f"{where} (drafter, features from the cache)"
        if topo.offline
        else f"{where} (target + drafter)"
    )
    notes = dict(_NOTES)
    d = F.DrafterDims.of(s, w.drafter_intermediate)
    variant_params = F.variant_head_params(w, d)[0]
    notes["drafter weights (fp32)"] = (
        f"{(F.drafter_param_count(d, w.drafter_layers, w.num_features) + variant_params) / 1e9:.2f} B parameters"
        + (f", {variant_params / 1e6:,.0f} M of them the {w.variant} variant's" if variant_params else "")
    )
    notes.update(F.variant_notes(w, d))
    notes["fused loss workspace"] = f"chunks of {min(chunk, w.loss_rows)} rows over {w.loss_rows:,} rows"
    peak_phase = max(phases, key=lambda p: sum(phases[p].values()))
    notes["temporaries (largest step)"] = {
        "rollout": "",
        "target forward": "",
        "drafter forward": "inside one layer's forward",
        "loss": "",
        "backward": "one layer's backward" + (" (recomputed first)" if w.activation_checkpointing else ""),
        "optimizer": "Muon's Newton-Schulz step" if w.optimizer == "muon" else "AdamW's step",
    }.get(peak_phase, "")
    notes["drafter activations (saved for backward)"] = (
        f"{w.drafter_layers} layers, {w.queries:,} queries x {w.keys:,} keys"
        + (", checkpointed" if w.activation_checkpointing else "")
    )
    notes["target weights"] = f"{target_param_count(s) / 1e9:.2f} B parameters, {w.target_dtype}"
    notes["target activations (body-only forward)"] = _forward_note(s, w, layer_ids)
    return _device(role, topo.drafter_gpus, topo, phases, order, notes)


def _untied_head(s: TargetShape) -> int:
    """Parameters of the output head a target rank drops (none when it is tied to the embedding)."""
    return 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size


def target_device_plan(s, w, topo, layer_ids, naive=False) -> DevicePlan:
    """A target rank: the target body's forward and the rows waiting to be sent. In the on-policy stage
    (``w.rollout_tokens``) it keeps the head (it verifies) and a copy of the drafter's weights (it
    drafts), and its rollout is a phase of its own, as on a drafter device that holds the target."""
    on_policy = bool(w.rollout_tokens)
    items = target_phases(s, w, layer_ids, naive, topo.threads, body_only=not on_policy)
    from .throughput import bytes_per_row

    items["rows queued for sending"] = w.prefetch * bytes_per_row(s, w)
    phases = {"target forward": items}
    if on_policy:
        d = F.DrafterDims.of(s, w.drafter_intermediate)
        head_params = F.variant_head_params(w, d)[0]
        items["drafter weights (fp32)"] = 4 * (F.drafter_param_count(d, w.drafter_layers, w.num_features) + head_params)
        static = {k: items[k] for k in ("target weights", "drafter weights (fp32)", "rows queued for sending")}
        phases = {"rollout": {**static, **F.rollout_items(s, w)}, "target forward": items}
    notes = dict(_NOTES)
    notes["rows queued for sending"] = f"topology.prefetch = {w.prefetch} rows may wait for the drafter rank"
    kept = target_param_count(s) - (0 if on_policy else _untied_head(s))
    notes["target weights"] = f"{kept / 1e9:.2f} B parameters, {w.target_dtype}" + (
        " (body and embedding: the output head stays on the drafter rank)" if kept < target_param_count(s) else ""
    )
    if on_policy:
        notes["drafter weights (fp32)"] = "the on-policy stage's copy, refreshed from the drafter rank every step"
    notes["captured hidden states"] = f"{len(layer_ids)} hooked layers + their [L, k*H] concatenation"
    notes["target activations (body-only forward)"] = _forward_note(s, w, layer_ids)
    order = list(items) + [k for k in phases.get("rollout", {}) if k not in items]
    return _device("target GPU", topo.target_gpus, topo, phases, order, notes)


def usable_for_peak(topo: Topology) -> int:
    """Largest tensor peak that fits: capacity minus the runtime reserve, divided by (1 + margin)."""
    return int((topo.memory - _runtime(topo)) / (1 + topo.allocator_margin))


def loss_kernel(w: F.Workload, topo: Topology, vocab: int) -> bool:
    """Whether the fused loss will run a kernel for its element-wise work on this device (the native
    CPU kernel, or Triton's on CUDA), which keeps its chunk buffers in the head dtype; else the eager
    passes' fp32 buffers. DSpark's per-row terms run in both kernels."""
    head_dtype = getattr(torch, w.target_dtype)
    if w.tv_weight > 0:  # TV's gradient runs in the eager passes (loss.fused)
        return False
    return planned_epilogue("auto", topo.device, head_dtype) != "eager"


def derive_chunk(
    s: TargetShape, w: F.Workload, topo: Topology, layer_ids: list[int], correct_fraction: float = 1.0
) -> tuple[int, int]:
    """``(chunk, largest fitting chunk)``: the loss chunk the planner picks when none is configured (the
    largest that fits, at most ``MAX_DERIVED_CHUNK`` and the number of loss rows) and the largest chunk
    whose workspace fits next to everything else at the loss phase (0 if none does)."""
    probe = drafter_phases(s, w, topo, layer_ids, 1, correct_fraction=correct_fraction)
    loss = probe["loss"]
    without = sum(loss.values()) - loss["fused loss workspace"]
    budget = usable_for_peak(topo) - without
    kernel = loss_kernel(w, topo, s.vocab_size)
    fit = F.chunk_for_budget(w, s.vocab_size, s.hidden_size, budget, correct_fraction, kernel) if budget > 0 else 0
    chunk = min(w.loss_rows, MAX_DERIVED_CHUNK, fit) if fit else min(w.loss_rows, 128)
    return max(1, chunk), fit


def make_plan(
    s: TargetShape,
    w: F.Workload,
    topo: Topology,
    layer_ids: list[int] | None = None,
    *,
    naive: bool = False,
    correct_fraction: float = 1.0,
    recommend: bool = True,
) -> Plan:
    """The plan of one configuration on one topology, with a recommendation when something does not fit."""
    ids = _target_layer_ids(s, w, layer_ids)
    if w.chunk_size is not None:
        chunk, source, fit = w.chunk_size, "loss.chunk_size", None
    else:
        chunk, fit = derive_chunk(s, w, topo, ids, correct_fraction)
        source = "derived from the memory left at the loss phase"
    devices = []
    if topo.target_gpus:
        devices.append(target_device_plan(s, w, topo, ids, naive))
    devices.append(drafter_device_plan(s, w, topo, ids, chunk, naive, correct_fraction))
    plan = Plan(s, w, topo, devices, chunk, source, naive)
    if topo.device == "cpu" and w.attention_backend == "flex":
        plan.notes.append(
            "FlexAttention has no backward pass on CPU: train on CPU with drafter.attention_backend=dense"
        )
    if w.attention_backend == "dense" and topo.device == "cuda":
        plan.notes.append(
            "dense attention on CUDA (mask + grouped KV heads) takes SDPA's math path, which keeps the "
            "[heads, Q, L+Q] probabilities: use drafter.attention_backend=flex on GPUs"
        )
    if recommend and not naive:
        plan.recommendations = recommendations(plan, ids, fit)
    return plan


def _fits(s, w, topo, ids, correct_fraction=1.0) -> bool:
    chunk = w.chunk_size or derive_chunk(s, w, topo, ids, correct_fraction)[0]
    return drafter_device_plan(s, w, topo, ids, chunk, False, correct_fraction).fits


def largest_anchors(s, w, topo, ids, upper: int) -> int:
    """Largest ``max_anchors`` (same block size) whose drafter device fits; 0 if not even one anchor."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(s, replace(w, max_anchors=mid), topo, ids):
            lo = mid
        else:
            hi = mid - 1
    return lo


def largest_seq_len(s, w, topo, ids) -> int:
    """Largest packed row (a multiple of 1024) whose target forward fits a target GPU."""
    lo, hi = 0, w.seq_len // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if target_device_plan(s, replace(w, seq_len=mid * 1024), topo, ids).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024


def recommendations(plan: Plan, ids: list[int], fit_chunk: int | None) -> list[str]:
    s, w, topo = plan.target, plan.workload, plan.topology
    out = []
    drafter = plan.devices[-1]
    # Anchors are distinct positions whose blocks may overlap: a one-document row holds at most
    # L - B + 1 of them (a 32K row takes thousands), not L / B.
    every = max(1, w.seq_len - w.block_size + 1)
    upper = min(max(w.max_anchors * 4, 1), every)
    best = largest_anchors(s, w, topo, ids, upper)
    if drafter.fits:
        if best >= every:
            out.append(f"headroom: even an anchor at every position fits ({best:,} x block {w.block_size})")
        elif best >= upper:
            out.append(
                f"headroom: at least {best:,} anchors x block {w.block_size} ({best * w.block_size:,} positions) fit"
            )
        else:
            out.append(
                f"headroom: up to data.max_anchors={best:,} x block {w.block_size} "
                f"({best * w.block_size:,} positions) fits"
            )
    else:
        if best:
            out.append(
                f"largest that fits: data.max_anchors={best} with block {w.block_size} "
                f"({best * w.block_size:,} positions)"
            )
        if not w.activation_checkpointing:
            ckpt = replace(w, activation_checkpointing=True)
            if _fits(s, ckpt, topo, ids):
                out.append(
                    "fits as configured with activation checkpointing: --set drafter.activation_checkpointing=true"
                )
            else:
                best_ckpt = largest_anchors(s, ckpt, topo, ids, upper)
                if best_ckpt > best:
                    out.append(f"with --set drafter.activation_checkpointing=true: data.max_anchors={best_ckpt} fits")
                    best = best_ckpt
        if not best:
            out.append(f"not even one anchor of block {w.block_size} fits the {drafter.role}")
    if fit_chunk is None:
        probe = replace(w, chunk_size=None)
        _, fit_chunk = derive_chunk(s, probe, topo, ids)
    if fit_chunk:
        out.append(
            f"loss chunk: up to {min(fit_chunk, w.loss_rows):,} rows keep the loss within the memory left "
            f"(loss.chunk_size; planner default {min(fit_chunk, w.loss_rows, MAX_DERIVED_CHUNK):,})"
        )
    else:
        out.append("loss chunk: no chunk size fits; the rest of the loss phase already exceeds the device")
    for dev in plan.devices:
        if dev.role == "target GPU" and not dev.fits:
            sl = largest_seq_len(s, w, topo, ids)
            if sl:
                out.append(f"target GPU: the longest packed row that fits is data.seq_len={sl:,}")
            else:
                out.append(vllm_layout(s, w, topo, ids))
    return out


VLLM_WEIGHT_SHARE = 0.7  # of each GPU: vLLM keeps its KV cache and activations beside the weights


def vllm_gpus(s: TargetShape, w: F.Workload, topo: Topology) -> int:
    """GPUs per vLLM server for this target: the fewest, a power of two (vLLM's tensor parallel sizes),
    that hold its weights within ``VLLM_WEIGHT_SHARE`` of each."""
    weights, tp = target_param_count(s) * F.DTYPE_BYTES[w.target_dtype], 1
    while weights / tp > VLLM_WEIGHT_SHARE * topo.memory and tp < 1024:
        tp *= 2
    return tp


def vllm_layout(s: TargetShape, w: F.Workload, topo: Topology, ids: list[int]) -> str:
    """The layout for a target whose weights do not fit one GPU: vLLM captures its features over the
    fewest GPUs (a power of two, its tensor parallel sizes) that hold the weights within
    ``VLLM_WEIGHT_SHARE`` of each, and the drafter trains from the cache (no target body)."""
    weights, tp = target_param_count(s) * F.DTYPE_BYTES[w.target_dtype], vllm_gpus(s, w, topo)
    drafter = drafter_device_plan(s, w, replace(topo, offline=True, target_gpus=0), ids, w.chunk_size or 1024)
    verdict = "fits" if drafter.fits else "does not fit either: see the drafter's lines above"
    return (
        f"target GPU: the target's weights ({weights / GB:,.0f} GB, {w.target_dtype}) do not fit one "
        f"{topo.device_name}: capture its features with vLLM over {tp} GPUs (capture.vllm.tensor_parallel_size={tp}, "
        f"weights at most {VLLM_WEIGHT_SHARE:.0%} of each; docs/large-targets.md), then train the drafter from them "
        f"(data.features, or data.feature_window while the capture runs): the drafter GPU alone peaks at "
        f"{drafter.total / GB:,.1f} GB and {verdict}"
    )
