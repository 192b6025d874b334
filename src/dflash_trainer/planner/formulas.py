"""Named memory formulas, one per thing that takes memory, each mirroring the code it prices.

Every function returns bytes and says which code it follows. Conventions:

    L  packed row length (data.seq_len)            Q  drafter query rows = max_anchors x block_size
    K  drafter keys per layer = L + Q              H, I, V  hidden, MLP and vocabulary sizes
    qd = heads x head_dim, kvd = kv_heads x head_dim (the drafter copies the target's attention shape)
    t  bytes of the target dtype (features, frozen embedding and head), c  bytes of the drafter's
       compute dtype (2 under bf16 autocast, else 4), parameters and optimizer states are fp32.

"Saved" means kept by autograd from the forward pass until the backward pass frees it; "transient"
means alive only inside one step of the computation. Tests compare these formulas with the real
objects (parameter counts, loss buffers) and with allocator measurements of real CPU steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..loss.workspace import chunk_loop_bytes
from .shapes import TargetShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Workload:
    """One drafter training step as the planner sees it (built from a ``RunConfig`` by ``plan.workload``)."""

    seq_len: int
    max_anchors: int
    block_size: int
    num_features: int = 5
    drafter_layers: int = 5
    sliding_window_layers: tuple[int, ...] = ()
    causal_in_block_sliding: bool = False
    attention_backend: str = "dense"
    train_dtype: str = "bfloat16"
    target_dtype: str = "bfloat16"
    noise: bool = False
    kl_weight: float = 0.0
    tv_weight: float = 0.0  # total variation: a per-row term of the eager passes, reads the teacher
    temperature: float = 1.0
    cap_weight: float = 0.0
    cap_temperature: float = 1.0
    labels: str = "data"
    optimizer: str = "adamw"  # train.optimizer: "muon" keeps one state per hidden matrix (muon_state_bytes)
    chunk_size: int | None = None
    grad_accum: int = 1
    activation_checkpointing: bool = False
    need_teacher_layers: bool = True  # the target runs past its last hooked layer (teacher hidden states)
    packed: bool = True  # rows hold several documents (the target's attention then needs a mask)
    prefetch: int = 2  # rows a target rank may run ahead of its drafter rank (topology.prefetch)
    drafter_intermediate: int | None = None  # drafter.intermediate_size; None = the target's width
    # The drafter variant (variants/): its heads' parameters (``variant_head_params``), the loss rows
    # it adds (label_shift: DSpark's anchor slot predicts), a Markov bias of this rank folded into the
    # loss GEMM, per-row loss terms (acceptance, Renyi, D-PARD: the eager chunk passes) and whether
    # its loss reads the teacher.
    variant: str = "dflash"
    label_shift: int = 0
    bias_rank: int = 0
    per_row_terms: bool = False
    variant_teacher: bool = False
    # the variant's settings as sorted (key, value) pairs: what it adds to a layer's activations and to
    # the loss phase it prices itself, beside its code (``Variant.layer_activations``, ``loss_activations``)
    variant_options: tuple = ()
    # train.stage=on_policy (training/on_policy.py): the longest rollout, prompt (at most a row) +
    # on_policy.max_new_tokens + a block of padding; 0 = an SFT run
    rollout_tokens: int = 0
    rollout_tree_budget: int = 0  # on_policy.rollout=ddtree: the tree's nodes per round; 0 = chain rollouts

    @property
    def queries(self) -> int:
        return self.max_anchors * self.block_size

    @property
    def keys(self) -> int:
        return self.seq_len + self.queries

    @property
    def loss_rows(self) -> int:
        """Rows the fused loss keeps (weight > 0): every slot but the anchor slot of every block. An upper
        bound: slots whose token has loss_mask 0, and padding blocks, are dropped by the loss."""
        return self.max_anchors * (self.block_size - 1 + self.label_shift)

    @property
    def need_teacher(self) -> bool:
        """Mirrors ``row_forward``: teacher hidden states are needed for KL, teacher labels or the variant."""
        return self.kl_weight > 0 or self.labels == "teacher" or self.variant_teacher or self.tv_weight > 0

    @property
    def t(self) -> int:
        return DTYPE_BYTES[self.target_dtype]

    @property
    def c(self) -> int:
        return 2 if self.autocast else 4

    @property
    def autocast(self) -> bool:
        return self.train_dtype == "bfloat16"

    @property
    def mask_variants(self) -> int:
        """Distinct attention masks ``DFlashDrafter.build_masks`` makes: full layers and sliding layers."""
        sliding = bool(self.sliding_window_layers)
        full = len(self.sliding_window_layers) < self.drafter_layers
        return int(sliding) + int(full)


@dataclass(frozen=True)
class DrafterDims:
    """The drafter's shape: ``DrafterSpec.from_target`` copies the target's attention and MLP sizes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, s: TargetShape, intermediate: int | None = None) -> DrafterDims:
        """``intermediate``: ``drafter.intermediate_size`` when set (see ``drafter_intermediate_size``)."""
        width = intermediate or s.intermediate_size
        return cls(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, width, s.vocab_size)

    @property
    def qd(self) -> int:
        return self.heads * self.head_dim

    @property
    def kvd(self) -> int:
        return self.kv_heads * self.head_dim


# -- the on-policy rollout -------------------------------------------------------------------------


def rollout_items(s: TargetShape, w: Workload) -> dict[str, int]:
    """Bytes alive while the target decodes one prompt with the drafter (``collect_rollout``), over
    ``R = w.rollout_tokens`` positions and blocks of B:

    - the target's KV cache: keys and values of every full-attention layer, ``2 * layers * kv_heads *
      head_dim * R`` in the target dtype (a linear-attention layer's recurrent state does not grow with R);
    - one verification pass over ``Q`` queries (a chain: the block, ``Q = B``; a DDTree: the anchor and
      its nodes, ``Q = 1 + budget``): its logits ``[Q, V]`` and every layer's hidden states
      ``[layers + 1, Q, H]`` (``output_hidden_states``: the hooked layers' features and the teacher rows),
      target dtype; a DDTree's additive ancestor mask ``[Q, R]`` in the target dtype;
    - the teacher rows a chain records for training, at most one block per generated token ``[R, B, H]``
      (a DDTree records none);
    - the drafter's context keys and values (``SpeculativeDecoder``), ``2 * drafter_layers * R * kv_dim``
      fp32."""
    r, b, t, d = w.rollout_tokens, w.block_size, w.t, DrafterDims.of(s, w.drafter_intermediate)
    tree = w.rollout_tree_budget
    q = 1 + tree if tree else b
    items = {
        "rollout KV cache (target)": 2 * s.num_full_attention * s.num_kv_heads * s.head_dim * r * t,
        "rollout verification pass": q * s.vocab_size * t + (s.num_layers + 1) * q * s.hidden_size * t,
    }
    if tree:
        items["rollout tree mask"] = q * r * t
    else:
        items["rollout teacher rows"] = r * b * s.hidden_size * t
    items["rollout drafter context (keys, values)"] = 2 * w.drafter_layers * r * d.kvd * 4
    return items


# -- parameters -----------------------------------------------------------------------------------


def drafter_layer_params(d: DrafterDims) -> int:
    """``DrafterLayer``: q/k/v/o projections, q_norm and k_norm (head_dim each), SwiGLU MLP, two RMSNorms."""
    h = d.hidden
    return h * d.qd + 2 * h * d.kvd + d.qd * h + 2 * d.head_dim + 3 * h * d.intermediate + 2 * h


def drafter_matmul_params(d: DrafterDims) -> int:
    """Parameters of one layer that go through a matmul (the ones autocast casts to bf16)."""
    h = d.hidden
    return h * d.qd + 2 * h * d.kvd + d.qd * h + 3 * h * d.intermediate


def drafter_param_count(d: DrafterDims, num_layers: int, num_features: int) -> int:
    """``DFlashDrafter``: ``fc`` (k*H -> H, no bias), ``hidden_norm``, the layers, ``norm``. The embedding
    and lm_head are the target's and are not drafter parameters."""
    return num_features * d.hidden * d.hidden + d.hidden + num_layers * drafter_layer_params(d) + d.hidden


def _variant(w: Workload):
    """``(variant, its typed settings)`` of the workload."""
    from ..variants import variant_of

    variant = variant_of(w.variant)
    return variant, variant.settings(dict(w.variant_options))


def variant_head_params(w: Workload, d: DrafterDims) -> tuple[int, int, int]:
    """``(parameters, tensors, largest tensor)`` of the variant's heads (0s for DFlash)."""
    variant, settings = _variant(w)
    shapes = variant.head_shapes(settings, d.hidden, d.vocab)
    shapes += variant.layer_shapes(settings, d.hidden) * w.drafter_layers
    sizes = [math.prod(shape) for shape in shapes]
    return sum(sizes), len(sizes), max(sizes, default=0)


def variant_layer_params(w: Workload, d: DrafterDims) -> int:
    """Parameters the variant adds to one decoder layer (DFlash2's two convolutions)."""
    variant, settings = _variant(w)
    shapes = variant.layer_shapes(settings, d.hidden)
    return sum(math.prod(shape) for shape in shapes)


def drafter_param_tensors(num_layers: int) -> int:
    """Number of parameter tensors (AdamW keeps one ``step`` scalar per tensor)."""
    return 3 + 11 * num_layers


def optimizer_state_bytes(params: int, tensors: int) -> int:
    """``torch.optim.AdamW``: ``exp_avg`` and ``exp_avg_sq`` in the parameters' dtype (fp32), plus a
    4-byte ``step`` per parameter tensor."""
    return 2 * 4 * params + 4 * tensors


def optimizer_step_transient(params: int, largest_param: int, device: str) -> int:
    """AdamW's step: on CUDA the foreach path allocates ``torch._foreach_sqrt(exp_avg_sqs)``, one fp32
    copy of every state; on CPU the per-tensor path makes ``exp_avg_sq.sqrt() / bc`` for one tensor
    at a time (two temporaries of the largest parameter)."""
    return 4 * params if device == "cuda" else 2 * 4 * largest_param


def muon_matrix_shapes(w: Workload, d: DrafterDims) -> list[tuple[int, int]]:
    """The matrices ``train.optimizer=muon`` gives to Muon (``training.optim.muon_matrices``): ``fc``,
    every layer's projections and MLP, the variant's 2-D tensors without a vocabulary-sized side."""
    h = d.hidden
    layer = [
        (d.qd, h),
        (d.kvd, h),
        (d.kvd, h),
        (h, d.qd),
        (d.intermediate, h),
        (d.intermediate, h),
        (h, d.intermediate),
    ]
    variant, settings = _variant(w)
    extra = variant.head_shapes(settings, h, d.vocab) + variant.layer_shapes(settings, h) * w.drafter_layers
    return (
        [(h, w.num_features * h)]
        + layer * w.drafter_layers
        + [tuple(s) for s in extra if len(s) == 2 and d.vocab not in s]
    )


def muon_rest_largest(w: Workload, d: DrafterDims) -> int:
    """The largest tensor AdamW keeps under ``train.optimizer=muon``: a norm's weight, or a variant's
    vocabulary-sized or non-matrix tensor."""
    variant, settings = _variant(w)
    shapes = variant.head_shapes(settings, d.hidden, d.vocab) + variant.layer_shapes(settings, d.hidden)
    return max([d.hidden] + [math.prod(s) for s in shapes if len(s) != 2 or d.vocab in s])


def muon_state_bytes(params: int, tensors: int, matrices: list[tuple[int, int]]) -> int:
    """``torch.optim.Muon`` keeps one fp32 ``momentum_buffer`` per matrix (no step count); AdamW keeps
    its two states and ``step`` for the other ``params - sum(matrices)`` parameters."""
    in_muon = sum(a * b for a, b in matrices)
    return 4 * in_muon + optimizer_state_bytes(params - in_muon, tensors - len(matrices))


def muon_step_transient(matrices: list[tuple[int, int]], device: str = "cuda", ns_bytes: int = 2) -> int:
    """Muon's step, one matrix ``[A, B]`` at a time: the Nesterov update in fp32 (4AB), its copy in the
    Newton-Schulz dtype and the next iterate (``ns_bytes`` AB each: 2 for bf16, 4 where a CPU without
    bf16 GEMMs iterates in fp32), the ``m x m`` Gram matrix and its polynomial (m = min(A, B)); the
    largest matrix sets it. On a CPU a bf16 GEMM may convert its operands and its result to fp32 (a
    workspace of at most 4 (m^2 + 2 m n), n = max(A, B)); cuBLAS and fp32 GEMMs need none."""

    def one(a: int, b: int) -> int:
        m, n = min(a, b), max(a, b)
        converts = device == "cpu" and ns_bytes == 2
        return 4 * a * b + ns_bytes * (2 * a * b + 2 * m * m) + (4 * (m * m + 2 * m * n) if converts else 0)

    return max((one(a, b) for a, b in matrices), default=0)


def drafter_largest_param(d: DrafterDims, num_features: int) -> int:
    return max(num_features * d.hidden * d.hidden, d.hidden * d.intermediate, d.hidden * d.qd)


# -- target ---------------------------------------------------------------------------------------


def target_weight_bytes(params: int, w: Workload) -> int:
    return params * w.t


def target_head_and_embedding_bytes(s: TargetShape, w: Workload) -> int:
    """The frozen ``embed_tokens`` and ``lm_head`` a drafter device needs (one tensor when tied)."""
    return (1 if s.tie_word_embeddings else 2) * s.vocab_size * s.hidden_size * w.t


def captured_features_bytes(s: TargetShape, w: Workload) -> int:
    """``TargetFeatures`` of one row: context ``[L, k*H]`` and, when needed, teacher ``[L, H]`` (target dtype)."""
    return w.seq_len * s.hidden_size * w.t * (w.num_features + (1 if w.need_teacher else 0))


def target_attention_mask_bytes(s: TargetShape, w: Workload) -> int:
    """Packed rows through HF's ``sdpa`` attention: ``create_causal_mask`` builds a boolean ``[L, L]``
    mask from the position ids (several documents per row). Targets that run each document on its own
    (``packs_documents`` False) and one-document rows take the ``is_causal`` path and build none."""
    return w.seq_len**2 if _target_masked(s, w) else 0


def _target_masked(s: TargetShape, w: Workload) -> bool:
    return s.packs_documents and w.packed


def target_mask_conversion_bytes(s: TargetShape, w: Workload) -> int:
    """Inside every attention layer, SDPA turns the boolean mask into an additive one in the query dtype
    (``aten.where``, ``[L, L] x t``), alive during that layer's attention."""
    return w.seq_len**2 * w.t if _target_masked(s, w) else 0


def cpu_flash_workspace(q_len: int, kv_len: int, kv_heads: int, head_dim: int, dtype_bytes: int, threads: int) -> int:
    """PyTorch's CPU flash-attention kernel (``cpu_flash_attention`` in ATen's FlashAttentionKernel.cpp)
    allocates, per call, an fp32 buffer per thread ``qSplit*kvSplit + 2*qSplit + qSplit*head_dim`` (qSplit
    256/64/32 by query length, kvSplit 512) and, for bf16, a bf16 ``[qSplit, kvSplit]`` per thread plus
    packed copies of K and V for its oneDNN GEMMs. Zero when ``threads`` is 0 (not a CPU run)."""
    if not threads:
        return 0
    qs = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    ks = min(512, kv_len)
    out = threads * (qs * ks + 2 * qs + qs * head_dim) * 4
    if dtype_bytes == 2:
        out += threads * qs * ks * 2 + 2 * kv_heads * kv_len * head_dim * 2
    return out


def _rmsnorm_transient(rows: int, width: int, t: int) -> int:
    """HF ``Qwen3RMSNorm`` without grad: ``x.to(float32)`` (a copy unless fp32), ``pow(2)``, ``x * rsqrt``,
    ``.to(input dtype)``; at most the fp32 copy, one fp32 temporary and the result are alive."""
    return rows * width * ((4 if t != 4 else 0) + 4 + t)


def target_layer_transient(s: TargetShape, w: Workload, kind: str, cpu_threads: int = 0) -> int:
    """Peak extra memory inside one decoder layer of a no-grad forward over ``L`` tokens, on top of its input
    (the residual). Attention layers: the normed input, q/k/v after their norms, RoPE's temporaries
    (``q*cos``, ``rotate_half``'s negated half and concatenation, ``*sin``) and the attention output;
    Gated DeltaNet layers (torch fallback, per document): projections, the fp32 [heads, L, d] copies of
    q, k, v, k*beta, v*beta, the chunked intra-chunk attention and the output; MLP: ``silu(gate)``,
    ``up`` and their product (``gate`` is freed once activated), ``[L, I]`` each."""
    L, h, t = w.seq_len, s.hidden_size, w.t
    normed = L * h * t
    # MoE: the routed tokens' expert activations (top-k widths) and the fp32 router logits
    router = L * s.num_experts * 4
    mlp = normed + 3 * L * s.mlp_active_width * t + L * h * t + router
    if kind == "linear_attention":
        # transformers' torch fallback (torch_chunk_gated_delta_rule; flash-linear-attention would use less):
        # q and k repeated to the value heads, v, beta, k*beta, v*beta, padded to 64-row chunks, the
        # triangular solves and their products, the output being built, all fp32 [heads, L, d] (about ten
        # alive at its peak), next to three fp32 [heads, chunks, 64, 64] decay/attention matrices; before
        # it, the causal conv's output [L, conv_dim] and the gate projections.
        kd = s.linear_num_key_heads * s.linear_key_head_dim
        vd = s.linear_num_value_heads * s.linear_value_head_dim
        nv, dk, dv = s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim
        proj = L * ((2 * kd + vd) + vd + 2 * nv) * t  # conv output, z, a and b
        fp32 = L * nv * 4 * (4 * dk + 6 * dv)
        chunk = 3 * L * nv * 64 * 4
        mixer = normed + proj + fp32 + chunk
    else:
        qd_out = s.num_heads * s.head_dim * (2 if s.attn_output_gate else 1)
        qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qkv = L * (qd + 2 * kvd) * t
        project = L * qd_out * t + _rmsnorm_transient(L, qd, t)  # q_proj output while q_norm runs
        rope = qkv + 3 * L * qd * t  # q*cos, rotate_half(q)*sin and their sum, next to q, k, v
        # transformers' sdpa integration repeats K and V to every head when a mask is given (no GQA path)
        repeat = 2 * L * qd * t if _target_masked(s, w) else 0
        kv_heads = s.num_heads if repeat else s.num_kv_heads
        attn = (
            qkv
            + repeat
            + target_mask_conversion_bytes(s, w)
            + L * qd * t
            + s.num_heads * L * 4
            + cpu_flash_workspace(L, L, kv_heads, s.head_dim, t, cpu_threads)
        )
        mixer = normed + max(project, rope, attn)
    return max(mixer, mlp, _rmsnorm_transient(L, h, t))


def target_forward_peak(s: TargetShape, w: Workload, layer_ids: list[int], cpu_threads: int = 0) -> dict[str, int]:
    """Peak of ``TargetModel.features`` above the weights: ``{'activations', 'captured', 'mask'}``.

    The body runs layer by layer; alive at layer l are the input embeddings (HF keeps ``inputs_embeds``),
    the RoPE tables, the mask, the hooked outputs captured so far, the layer's input (the previous
    layer's output, counted once: when that layer is hooked it is the captured tensor itself, and layer
    0's input is ``inputs_embeds``) and the layer's own temporaries. The forward stops after the last hooked
    layer unless teacher states are needed (then all layers and the final norm run). At the end
    ``torch.cat`` copies the captured outputs into the context ``[L, k*H]`` while they are still alive."""
    L, h, t = w.seq_len, s.hidden_size, w.t
    last = s.num_layers - 1 if w.need_teacher_layers else max(layer_ids)
    fixed = L * h * t + 2 * L * s.head_dim * t  # inputs_embeds, cos and sin
    hooked = sorted(set(layer_ids))
    peak_act, peak_total = 0, 0
    for layer in range(last + 1):
        captured = sum(1 for i in hooked if i < layer) * L * h * t
        residual = 0 if layer == 0 or layer - 1 in hooked else L * h * t
        act = residual + target_layer_transient(s, w, s.layer_types[layer], cpu_threads)
        if fixed + act + captured > peak_total:
            peak_total, peak_act = fixed + act + captured, fixed + act
    k = len(layer_ids)
    end = fixed + L * h * t * (2 * k + (2 if w.need_teacher else 0))  # captured + context (+ final norm in/out)
    mask = target_attention_mask_bytes(s, w)
    if end > peak_total:
        return {
            "activations": fixed + (2 * L * h * t if w.need_teacher else 0),
            "captured": 2 * k * L * h * t,
            "mask": mask,
        }
    return {"activations": peak_act, "captured": peak_total - peak_act, "mask": mask}


# -- drafter activations --------------------------------------------------------------------------


def _norm_saved(rows: int, width: int, in_bytes: int, input_saved_elsewhere: bool, needs_grad_in: bool = True) -> int:
    """``drafter.RMSNorm`` in training: ``x.float()`` (a copy when x is not fp32), ``rsqrt`` ``[rows]`` and
    ``x * rsqrt`` cast back to x's dtype are saved. When x is fp32 the cast is a no-op and x itself is
    saved (unless something else already keeps it)."""
    if in_bytes == 4:
        x = 0 if input_saved_elsewhere or not needs_grad_in else rows * width * 4
        return x + (rows * 4 if needs_grad_in else 0) + rows * width * 4
    return rows * width * 4 + rows * 4 + rows * width * in_bytes


def stem_saved(d: DrafterDims, w: Workload) -> dict[str, int]:
    """Saved once per forward, before the layers: ``fc``'s input (features cast to bf16 under autocast, or
    the fp32 features when they had to be copied), ``hidden_norm``'s tensors, the context rows when fp32
    projections keep them, and the four RoPE tables (``[T, head_dim]`` fp32, T = L or Q)."""
    L, Q, h, k = w.seq_len, w.queries, d.hidden, w.num_features
    new_fp32 = w.t != 4 or w.noise  # DFlashDrafter.context: features.to(fp32) copies, noise makes a new tensor
    fc_in = L * k * h * 2 if w.autocast else (L * k * h * 4 if new_fp32 else 0)
    ctx_saved = L * h * 4 if (not w.autocast or w.activation_checkpointing) else 0  # fp32 k/v_proj or checkpoint input
    return {
        "fc input": fc_in,
        "hidden_norm": _norm_saved(L, h, w.c, input_saved_elsewhere=False),
        "context rows": ctx_saved,
        "rope tables": 2 * (L + Q) * d.head_dim * 4,
    }


def layer_saved(d: DrafterDims, w: Workload, device: str, first: bool) -> dict[str, int]:
    """What one ``DrafterLayer`` (with its ``keys_values`` of the context rows) keeps for backward.

    Follows the forward: input RMSNorm; the q/k/v projections' inputs (three bf16 casts under autocast,
    one shared fp32 tensor otherwise); q_norm and k_norm on the block rows and k_norm on the L context
    rows; the keys ``cat([context, block])`` and values as attention sees them; the attention's own saved
    tensors (see ``attention_saved``); the residual; the post-attention norm and the MLP's gate, silu,
    up and product ``[Q, I]``; the layer output. Under autocast the bf16 copies of the layer's weights
    are saved too (the matmuls need them for the input gradients)."""
    L, Q, h, c = w.seq_len, w.queries, d.hidden, w.c
    proj_in = (3 if w.autocast else 1) * Q * h * c  # q/k/v inputs
    out = {
        "input norm": _norm_saved(Q, h, 4, input_saved_elsewhere=True, needs_grad_in=not first) + proj_in,
        "q, k norms (block rows)": _norm_saved(Q * d.heads, d.head_dim, c, False)
        + _norm_saved(Q * d.kv_heads, d.head_dim, c, False),
        "context keys/values": (2 * L * h * 2 if w.autocast else 0) + _norm_saved(L * d.kv_heads, d.head_dim, c, False),
        "attention": attention_saved(d, w, device),
        "residual + post norm": Q * h * 4 + _norm_saved(Q, h, 4, True) + (2 if w.autocast else 1) * Q * h * c,
        "mlp": 4 * Q * d.intermediate * c,
        "layer output": Q * h * 4,
    }
    out.update(variant_layer_items(d, w))
    if w.autocast:
        out["bf16 weight copies"] = drafter_matmul_params(d) * 2
    return out


def variant_layer_items(d: DrafterDims, w: Workload) -> dict[str, int]:
    """What the variant adds to one layer's saved activations, by item name (``Variant.layer_activations``:
    DFlash2's convolutions, priced in ``variants/dflash2/cost.py``)."""
    variant, settings = _variant(w)
    return variant.layer_activations(settings, w.queries, d.hidden, w.c, w.autocast)


def variant_layer_backward(d: DrafterDims, w: Workload) -> int:
    """The variant's temporaries in one layer's backward (``Variant.layer_backward_transient``)."""
    variant, settings = _variant(w)
    return variant.layer_backward_transient(settings, w.queries, d.hidden)


def variant_loss_items(w: Workload, d: DrafterDims) -> dict[str, int]:
    """What the variant's heads keep alive in the loss phase, by item name (``Variant.loss_activations``:
    DFlash2's selector rows, priced in ``variants/dflash2/cost.py``)."""
    variant, settings = _variant(w)
    return variant.loss_activations(settings, w.loss_rows, d.hidden, w.autocast)


def variant_notes(w: Workload, d: DrafterDims) -> dict[str, str]:
    """The plan's notes on the variant's items (``Variant.planner_notes``)."""
    variant, settings = _variant(w)
    return variant.planner_notes(settings, w.loss_rows, d.vocab)


def attention_saved(d: DrafterDims, w: Workload, device: str) -> int:
    """Queries, keys and values as the attention kernel receives them (bf16 casts under autocast), plus
    what the kernel itself keeps:

    - ``dense`` on CPU (``_scaled_dot_product_flash_attention_for_cpu``): the boolean mask converted to an
      additive ``[Q, K]`` mask in the query dtype, the output and the log-sum-exp;
    - ``dense`` on CUDA: with a mask and grouped KV heads SDPA falls back to the math path, which keeps
      the ``[heads, Q, K]`` probabilities and K, V repeated to every head (a GPU prediction);
    - ``flex`` on CUDA (compiled FlexAttention): output and log-sum-exp only, and the ``[Q, qd]`` copy
      ``o_proj`` receives (flex's output is head-major, the transpose-reshape copies it)."""
    Q, K, c = w.queries, w.keys, w.c
    qkv = Q * d.qd * c + 2 * d.kv_heads * K * d.head_dim * c
    lse = d.heads * Q * 4
    if w.attention_backend == "flex":
        return qkv + Q * d.qd * c + lse + Q * d.qd * c
    if device == "cuda":
        return qkv + d.heads * Q * K * c + 2 * d.heads * K * d.head_dim * c + Q * d.qd * c + Q * d.qd * c
    return qkv + Q * K * c + Q * d.qd * c + lse


def layer_forward_transient(d: DrafterDims, w: Workload, device: str, cpu_threads: int = 0) -> int:
    """The largest temporary inside a layer's forward, on top of what it saves: the context keys and
    values ``keys_values`` returns (fp32 rotated keys and values, held by the loop until the next layer),
    plus the largest of RoPE's temporaries on the queries, the fp32 ``cat`` of the keys before its bf16
    cast, and (CUDA ``dense``) the attention scores."""
    L, Q, K = w.seq_len, w.queries, w.keys
    held = L * d.kvd * (4 + w.c)
    rope = Q * d.qd * 4 * 4
    cat = d.kv_heads * K * d.head_dim * 4 + Q * d.kvd * 4 if w.autocast else Q * d.kvd * 4
    scores = d.heads * Q * K * w.c if (w.attention_backend == "dense" and device == "cuda") else 0
    if device == "cpu" and w.attention_backend == "dense":
        scores = cpu_flash_workspace(Q, K, d.kv_heads, d.head_dim, w.c, cpu_threads)
    ctx_rope = L * d.kvd * 4 * 3
    return held + max(rope, cat, scores, ctx_rope)


def checkpointed_layer_forward(d: DrafterDims, w: Workload) -> int:
    """A checkpointed layer's forward keeps nothing for backward, so its tensors die as in a no-grad run;
    the most alive at once is at the MLP: the normed input (and its bf16 casts) with ``silu(gate)``,
    ``up`` and their product."""
    Q, h, c = w.queries, d.hidden, w.c
    return Q * h * 4 + (2 * Q * h * c if w.autocast else 0) + 3 * Q * d.intermediate * c


def stem_forward_transient(d: DrafterDims, w: Workload) -> int:
    """``DFlashDrafter.context`` and the embedding: the fp32 copy of the features (bf16 targets), two
    fp32 temporaries of the uniform/Gaussian noise expression, then ``fc``'s output and ``hidden_norm``'s
    fp32 temporaries; the context rows ``[L, H]`` fp32 stay alive through the whole forward."""
    L, h, k = w.seq_len, d.hidden, w.num_features
    copy = L * k * h * 4 if (w.t != 4 or w.noise) else 0
    noise = 2 * L * k * h * 4 if w.noise else 0
    fc = L * h * w.c + 2 * L * h * 4
    rope = 3 * L * d.head_dim * 8  # rope_cos_sin works in float64
    return copy + max(noise, fc, rope) + (L * k * h * 4 if w.noise and w.t == 4 else 0)


def attention_mask_bytes(d: DrafterDims, w: Workload) -> int:
    """Masks of one row, one per distinct layer variant (``build_masks``): dense ``[Q, L+Q]`` booleans, or
    a FlexAttention ``BlockMask`` (int32 block counts and indices for rows and columns, full and
    partial, over 128 x 128 tiles)."""
    Q, K = w.queries, w.keys
    if w.attention_backend == "flex":
        qb, kb = -(-Q // 128), -(-K // 128)
        per = 4 * (2 * qb * kb + 2 * qb + 2 * kb * qb + 2 * kb)
    else:
        per = Q * K
    return per * w.mask_variants


def mask_build_transient(w: Workload) -> int:
    """``dense_mask``: the ``[Q, L]`` context part and ``[Q, Q]`` block part exist next to the ``cat`` result.
    ``flex_block_mask`` compiled on CUDA works tile by tile (small)."""
    if w.attention_backend == "flex":
        return 0
    return w.queries * w.keys


def layer_backward_peak(
    d: DrafterDims, w: Workload, saved: dict[str, int], below_has_ctx_grad: bool, cpu_threads: int = 0
) -> int:
    """Peak of one layer's backward (its own saved tensors plus gradients), in the order autograd runs it:

    - MLP: everything the layer saved is still alive; ``down_proj``'s backward frees its input (the
      product) and ``mul``'s backward then holds the gradients of the product, ``silu(gate)`` and ``up``,
      plus (autocast) a weight gradient in bf16 before its fp32 cast;
    - attention: the MLP's and post-norm's tensors are gone; the gradients of q, k, v in the compute
      dtype appear (K and V over all L+Q keys), plus the CPU kernel's workspace;
    - context keys/values: only their own saved tensors are left; ``k_norm``'s backward over the L
      context rows makes four fp32 ``[L, kvd]`` temporaries, and the fp32 gradients of the context rows
      (one per projection) are summed into the ``[L, H]`` accumulator ``ctx`` keeps across layers.

    ``saved`` is ``layer_saved``'s dict; ``below_has_ctx_grad``: the accumulator already exists (every
    layer but the last)."""
    Q, K, L, c, h = w.queries, w.keys, w.seq_len, w.c, d.hidden
    total = sum(saved.values())
    grad_x = 2 * Q * h * 4  # the gradient arriving at the layer output and the one leaving through the residual
    acc = L * h * 4 if below_has_ctx_grad else 0
    mlp = total + 2 * Q * d.intermediate * c + (h * d.intermediate * c if w.autocast else 0) + grad_x + acc
    mlp += variant_layer_backward(d, w)
    after_mlp = total - saved["mlp"] - saved["residual + post norm"] - saved["layer output"]
    attn = (
        after_mlp
        + Q * d.qd * c
        + 2 * d.kv_heads * K * d.head_dim * c
        + grad_x
        + acc
        + cpu_flash_workspace(Q, K, d.kv_heads, d.head_dim, c, cpu_threads)
    )
    ctx = saved["context keys/values"] + 2 * L * h * 4 + 4 * L * d.kvd * 4 + L * d.kvd * (4 + c)
    return max(mlp, attn, ctx)


# -- loss -----------------------------------------------------------------------------------------


def loss_workspace(
    w: Workload, vocab: int, hidden: int, chunk: int, correct_fraction: float = 1.0, kernel: bool = False
) -> dict[str, int]:
    """The fused loss's workspace on the step's ``w.loss_rows`` rows in chunks of ``chunk`` rows, as the
    loss prices it beside its code (``loss.workspace.chunk_loop_bytes``)."""
    return chunk_loop_bytes(
        rows=w.loss_rows,
        queries=w.queries,
        vocab=vocab,
        hidden=hidden,
        chunk=chunk,
        head_bytes=w.t,
        teacher=w.need_teacher,
        kl_weight=w.kl_weight,
        temperature=w.temperature,
        cap_weight=w.cap_weight,
        cap_temperature=w.cap_temperature,
        tv_weight=w.tv_weight,
        per_row_terms=w.per_row_terms,
        bias_rank=w.bias_rank,
        correct_fraction=correct_fraction,
        kernel=kernel,
    )


def loss_inputs_bytes(w: Workload, hidden: int) -> int:
    """``loss_of`` and ``fused_draft_loss``: the drafter output cast to the head's dtype ``[N, H]``, the
    gathered teacher rows ``[N, H]``, and the compacted copies of both for the rows with weight > 0."""
    N, n, t = w.queries, w.loss_rows, w.t
    cast = N * hidden * t if t != 4 else 0
    teacher = N * hidden * t if w.need_teacher else 0
    return cast + teacher + n * hidden * t * (2 if w.need_teacher else 1)


def loss_backward_bytes(w: Workload, hidden: int) -> int:
    """The loss's backward op: ``grad_output * dh_s`` ``[N, H]`` (fp32) and its cast to the head dtype,
    then the fp32 gradient of ``loss_of``'s cast to the head dtype while the cast is alive."""
    N, t = w.queries, w.t
    return N * hidden * 4 + (N * hidden * t if t != 4 else 0)


def chunk_for_budget(
    w: Workload, vocab: int, hidden: int, budget: int, correct_fraction: float = 1.0, kernel: bool = False
) -> int:
    """Largest chunk whose loss workspace fits ``budget`` bytes (0 if not even one row does)."""
    lo, hi = 0, max(1, w.loss_rows)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(loss_workspace(w, vocab, hidden, mid, correct_fraction, kernel).values()) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- the pipeline without this project's fixes (--naive) ------------------------------------------


def naive_target_extra(s: TargetShape, w: Workload) -> dict[str, int]:
    """HF ``model(..., output_hidden_states=True)`` on a packed row: logits over all L positions
    (``[L, V]`` in the target dtype; DESIGN.md section 1 item 1) and every layer's hidden state kept."""
    L = w.seq_len
    return {
        "target logits [L x V]": L * s.vocab_size * w.t,
        "all hidden states (output_hidden_states)": (s.num_layers + 1) * L * s.hidden_size * w.t,
    }


def naive_drafter_extra(s: TargetShape, w: Workload) -> dict[str, int]:
    """Verifier logits over the whole row, rolled and indexed down to the anchored positions (item 2), and
    the loss on materialized ``[N, V]`` tensors (items 3-4): student and teacher logits, a softmax for
    CE and about three softmax-sized tensors for KL, kept for the backward."""
    L, N, V, t = w.seq_len, w.queries, s.vocab_size, w.t
    out = {"verifier logits [L x V]": L * V * t, "rolled copy [L x V]": L * V * t, "selected logits [N x V]": N * V * t}
    per = N * V * t
    out["student logits + CE softmax [N x V]"] = 2 * per
    if w.need_teacher:
        out["teacher logits [N x V]"] = per
    if w.kl_weight > 0:
        out["KL softmax / log-softmax / product [N x V]"] = 3 * per
    return out
