"""The DFlash drafter: Qwen3-style decoder layers over draft blocks, with KV injection of target features.

    context feats [L, k*H] --fc--> [L, H] --hidden_norm--> ctx          (once per row)
    block tokens  [nb, B]  --target embedding (frozen, shared)--> x   [nb*B, H]
    each layer:   x += attn(q = x, k/v = [ctx ; x] through the layer's own k_proj/v_proj), x += mlp(x)
    output:       norm(x) [nb*B, H]   (the loss projects it with the target's frozen lm_head)

Context rows are keys and values only, never queries. RoPE positions are absolute: context rows
keep their own position, slot k of a block sits at pos(anchor) + k. Which context rows and block
keys a query sees is the attention mask's business (``model/attention.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import UserError
from .attention import MaskSpec, dense_mask, flex_block_mask
from .rope import apply_rope, rope_cos_sin
from .target import head_logit_options, text_config


@dataclass(frozen=True)
class DrafterSpec:
    """Everything that shapes a drafter; derived from the target's config and the run's drafter config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int = 5
    num_features: int = 5  # k target layers
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # drafter.rope_scaling as transformers' rope_parameters read it ({"rope_type": "yarn", "factor", ...});
    # None: default RoPE, and the JSON form leaves it out (as before scaling existed)
    rope_scaling: dict | None = field(default=None, hash=False)
    sliding_window_layers: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int = 2048
    causal_in_block_sliding: bool = False
    noise: str = "none"
    noise_scale: float = 0.0
    mask_token_id: int = 0
    activation_checkpointing: bool = False  # training only: recompute each layer in the backward pass
    # The target head's logit transform (loss.logits.transform_logits): the drafter holds the head, so
    # it carries how the head's logits are post-processed too.
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    # The drafter variant (``variants/``) and its settings (``variants/<name>/settings.py``) as the plain
    # dict a drafter's config file stores (``Variant.settings`` types them): DFlash has none, and a
    # DFlash spec's JSON form leaves both out, as before variants existed.
    variant: str = "dflash"
    variant_options: dict = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict:
        """The JSON form (checkpoints, exports); DFlash's is what it was before variants existed."""
        d = dataclasses.asdict(self)
        if self.variant == "dflash" and not self.variant_options:
            del d["variant"], d["variant_options"]
        if self.rope_scaling is None:
            del d["rope_scaling"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterSpec:
        """A spec from its JSON form (checkpoints, exports): lists back to tuples, absent fields default."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"unknown drafter spec fields {unknown}: written by a newer dflash-trainer?")
        from ..errors import check_schema

        layers = d.get("sliding_window_layers", ())
        d = {**d, "sliding_window_layers": tuple(layers) if isinstance(layers, list) else layers}
        # every field by its annotation, strict JSON types: a damaged one is one line naming it
        check_schema(_spec_schema(), d, "drafter spec", "the file is damaged")
        return cls(**d)

    @property
    def logit_options(self) -> dict:
        """Keyword arguments of ``transform_logits`` and the fused loss for this drafter's head."""
        return {"logit_scale": self.logit_scale, "softcap": self.logit_softcap}

    @classmethod
    def from_target(cls, target_config, drafter_cfg, *, num_features: int, mask_token_id: int) -> DrafterSpec:
        c = text_config(target_config)
        head = head_logit_options(c)
        variant = getattr(drafter_cfg, "variant", "dflash")
        settings = getattr(drafter_cfg, variant, None) if variant != "dflash" else None
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            intermediate_size=drafter_intermediate_size(c, getattr(drafter_cfg, "intermediate_size", None)),
            vocab_size=c.vocab_size,
            num_layers=drafter_cfg.num_layers,
            num_features=num_features,
            block_size=drafter_cfg.block_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=float(theta or getattr(c, "rope_theta", 1e6)),
            rope_scaling=drafter_cfg.rope_scaling.as_rope_parameters()
            if getattr(drafter_cfg, "rope_scaling", None)
            else None,
            sliding_window_layers=tuple(drafter_cfg.sliding_window_layers),
            sliding_window=drafter_cfg.sliding_window,
            causal_in_block_sliding=drafter_cfg.causal_in_block_sliding,
            noise=drafter_cfg.noise,
            noise_scale=drafter_cfg.noise_scale,
            mask_token_id=mask_token_id,
            activation_checkpointing=getattr(drafter_cfg, "activation_checkpointing", False),
            logit_scale=head["logit_scale"],
            logit_softcap=head["softcap"],
            variant=variant,
            variant_options=settings.model_dump() if settings is not None else {},
        )

    def layer_mask_spec(self, layer: int) -> MaskSpec:
        if layer in self.sliding_window_layers:
            return MaskSpec(window=self.sliding_window, causal_in_block=self.causal_in_block_sliding)
        return MaskSpec()


def drafter_intermediate_size(target_text_config, configured: int | None = None) -> int:
    """The drafter's dense MLP width: ``configured`` (``drafter.intermediate_size``), else the target's
    ``intermediate_size`` (z-lab's drafters copy it: for Qwen3-30B-A3B that is the dense 6144, not the
    768 of one expert), else 3 x hidden_size for MoE configs that carry no dense width (Qwen3.5-MoE;
    the same ratio as Qwen3-30B-A3B's 6144 = 3 x 2048)."""
    if configured is not None:
        return int(configured)
    width = getattr(target_text_config, "intermediate_size", None)
    return int(width) if width else 3 * int(target_text_config.hidden_size)


def resolve_mask_token_id(tokenizer, configured: int | None, vocab_size: int) -> int:
    """The configured id, else the tokenizer's ``<|MASK|>``; never a silent fallback to pad or eos."""
    if configured is not None:
        mask_id, source = configured, "drafter.mask_token_id"
    else:
        mask_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        if mask_id is None and tokenizer is not None:
            unk = getattr(tokenizer, "unk_token_id", None)
            found = tokenizer.convert_tokens_to_ids("<|MASK|>")
            mask_id = found if found is not None and found != unk else None
        source = "the tokenizer's <|MASK|> token"
        if mask_id is None:
            raise UserError(
                "no mask token: the tokenizer has no <|MASK|> (mask_token) and drafter.mask_token_id is "
                "not set; add the token to the tokenizer or set drafter.mask_token_id"
            )
    if not 0 <= mask_id < vocab_size:
        raise UserError(f"mask token id {mask_id} from {source} is outside the target vocabulary 0..{vocab_size - 1}")
    return int(mask_id)


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalize in fp32 (float64 stays float64: the tests' references), scale in the
    input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


_COMPILED_FLEX = None


def _flex_attention(device: torch.device):
    """Compiled FlexAttention on GPUs (the fused kernel); eager elsewhere, where torch's unfused
    implementation materializes the scores (fine for the small CPU shapes it is tested on)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        # Shapes vary with the row length and block count; let dynamo mark them dynamic after the
        # first recompile instead of specializing on every new shape.
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


class DrafterAttention(nn.Module):
    def __init__(self, s: DrafterSpec):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``[T, H]`` rows -> keys and values ``[kv_heads, T, d]`` (normed, rotated keys)."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.s.num_kv_heads, self.s.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(t, self.s.num_kv_heads, self.s.head_dim).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, x, context_kv, cos_q, sin_q, mask, backend: str):
        """``x`` ``[Q, H]`` block rows; ``context_kv`` keys/values ``[kv_heads, L, d]`` of the context
        rows; ``mask`` ``[Q, L+Q]`` bool, a BlockMask, or None (every key visible)."""
        n_q = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n_q, self.s.num_heads, self.s.head_dim)).transpose(0, 1)
        q = apply_rope(q, cos_q, sin_q)
        k_blk, v_blk = self.keys_values(x, cos_q, sin_q)
        k = torch.cat([context_kv[0], k_blk], dim=1)[None]
        v = torch.cat([context_kv[1], v_blk], dim=1)[None]
        if backend == "flex":
            out = _flex_attention(q.device)(q[None], k, v, block_mask=mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out[0].transpose(0, 1).reshape(n_q, -1))


class DrafterMLP(nn.Module):
    def __init__(self, s: DrafterSpec):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """A pre-norm decoder layer. A variant may wrap its two sublayers (``attention_conv``, ``mlp_conv``,
    None in DFlash; DFlash2's local convolutions): ``prepare(x) -> (x', state)`` on the sublayer's
    input and ``finish(y, state) -> y'`` on its output, inside the residual branch."""

    def __init__(self, s: DrafterSpec):
        super().__init__()
        self.self_attn = DrafterAttention(s)
        self.mlp = DrafterMLP(s)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.register_module("attention_conv", None)
        self.register_module("mlp_conv", None)

    def forward(self, x, context_kv, cos_q, sin_q, mask, backend):
        h, state = _prepare(self.attention_conv, self.input_layernorm(x))
        x = x + _finish(self.attention_conv, self.self_attn(h, context_kv, cos_q, sin_q, mask, backend), state)
        h, state = _prepare(self.mlp_conv, self.post_attention_layernorm(x))
        return x + _finish(self.mlp_conv, self.mlp(h), state)


def _prepare(wrap, x):
    return (x, None) if wrap is None else wrap.prepare(x)


def _finish(wrap, y, state):
    return y if wrap is None else wrap.finish(y, state)


def _layer_step(layer: DrafterLayer, x, ctx, cos_c, sin_c, cos_q, sin_q, mask, backend):
    """One layer of the training layout: its own keys/values of the context rows, then the layer."""
    return layer(x, layer.self_attn.keys_values(ctx, cos_c, sin_c), cos_q, sin_q, mask, backend)


class DFlashDrafter(nn.Module):
    """``fc``, ``hidden_norm``, ``layers``, ``norm``; the embedding and lm_head stay the target's."""

    def __init__(self, spec: DrafterSpec, embed_tokens: nn.Embedding, lm_head_weight: torch.Tensor):
        super().__init__()
        s = spec
        if s.block_size < 2:
            raise UserError(f"drafter block_size must be >= 2, got {s.block_size}")
        if embed_tokens.weight.shape != (s.vocab_size, s.hidden_size):
            raise UserError(
                f"target embedding is {tuple(embed_tokens.weight.shape)}, drafter expects "
                f"[vocab {s.vocab_size}, hidden {s.hidden_size}]"
            )
        if s.sliding_window_layers and s.sliding_window < 1:
            raise UserError(f"sliding_window must be >= 1 context row, got {s.sliding_window}")
        if not 0 <= s.mask_token_id < s.vocab_size:
            raise UserError(f"mask token id {s.mask_token_id} is outside the vocabulary 0..{s.vocab_size - 1}")
        self.spec = s
        self.fc = nn.Linear(s.num_features * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(s) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        # Shared with the target, frozen, and deliberately not registered: not parameters of the
        # drafter, not in its state_dict, never copied.
        self.target_embed = (embed_tokens,)
        self._lm_head = (lm_head_weight,)
        self.mask_specs = [s.layer_mask_spec(i) for i in range(s.num_layers)]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The target's frozen ``[V, H]`` head (shared, not a drafter parameter)."""
        return self._lm_head[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables ``([T, d], [T, d])`` of ``positions`` ``[T]``: the spec's base and scaling."""
        s = self.spec
        return rope_cos_sin(positions, s.head_dim, s.rope_theta, dtype, s.rope_scaling)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target embedding of ``ids``, detached: the embedding is frozen even if the caller's is not."""
        return F.embedding(ids, self.target_embed[0].weight.detach()).to(self.dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """``[L, k*H]`` target features -> ``[L, H]`` context rows (noise only in training mode)."""
        expected = self.spec.num_features * self.spec.hidden_size
        if features.shape[-1] != expected:
            raise UserError(
                f"context features have width {features.shape[-1]}, the drafter expects "
                f"{self.spec.num_features} layers x hidden {self.spec.hidden_size} = {expected}"
            )
        features = features.to(self.dtype)
        if self.training and self.spec.noise != "none" and self.spec.noise_scale > 0:
            if self.spec.noise == "uniform":
                features = features + (torch.rand_like(features) * 2 - 1) * self.spec.noise_scale
            else:
                features = features + torch.randn_like(features) * self.spec.noise_scale
        return self.hidden_norm(self.fc(features))

    def build_masks(self, anchors, block_doc, context_doc, backend: str) -> dict[MaskSpec, object]:
        """One mask per distinct layer variant, for ``nb`` blocks over a row of ``L`` context rows."""
        make = flex_block_mask if backend == "flex" else dense_mask
        return {
            spec: make(anchors, block_doc, context_doc, self.spec.block_size, spec) for spec in set(self.mask_specs)
        }

    def forward(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        features: torch.Tensor,
        context_positions: torch.Tensor,
        masks: dict,
        backend: str = "dense",
    ) -> torch.Tensor:
        """Training layout: all ``nb`` blocks ``[nb, B]`` against one row's features ``[L, k*H]`` with
        positions ``[L]``; ``masks`` from ``build_masks``. Returns final-normed hidden ``[nb*B, H]``."""
        if backend not in ("dense", "flex"):
            raise UserError(f"attention backend must be 'dense' or 'flex', got {backend!r}")
        if backend == "flex" and features.device.type == "cpu" and torch.is_grad_enabled():
            raise UserError("FlexAttention has no backward pass on CPU: train on CPU with the dense backend")
        ctx = self.context(features)
        x = self._embed(block_ids.reshape(-1))
        cos_q, sin_q = self.rope(block_positions.reshape(-1), x.dtype)
        cos_c, sin_c = self.rope(context_positions, x.dtype)
        # Activation checkpointing keeps only each layer's inputs (x; ctx and the tables are shared) and
        # recomputes the layer, context keys/values included, in the backward pass (planner/formulas.py).
        recompute = self.spec.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer, spec in zip(self.layers, self.mask_specs):
            args = (layer, x, ctx, cos_c, sin_c, cos_q, sin_q, masks[spec], backend)
            x = checkpoint(_layer_step, *args, use_reentrant=False) if recompute else _layer_step(*args)
        return self.norm(x)

    @torch.no_grad()
    def draft_block(self, anchor_token: int, anchor_position: int, cache: list) -> torch.Tensor:
        """Serving layout: one block ``[anchor, MASK x (B-1)]`` against cached context keys/values
        (``context_cache``). Returns the block's final-normed hidden ``[B, H]``."""
        b = self.spec.block_size
        ids = torch.full((b,), self.spec.mask_token_id, dtype=torch.long, device=self.fc.weight.device)
        ids[0] = anchor_token
        x = self._embed(ids)
        pos = anchor_position + torch.arange(b, device=ids.device)
        cos_q, sin_q = self.rope(pos, x.dtype)
        for layer, spec, (k, v) in zip(self.layers, self.mask_specs, cache):
            if spec.window is not None:
                k, v = k[:, -spec.window :], v[:, -spec.window :]
            mask = None
            if spec.causal_in_block:
                n_ctx = k.shape[1]
                mask = torch.ones(b, n_ctx + b, dtype=torch.bool, device=ids.device)
                mask[:, n_ctx:] = torch.ones(b, b, dtype=torch.bool, device=ids.device).tril()
            x = layer(x, (k, v), cos_q, sin_q, mask, "dense")
        return self.norm(x)

    @torch.no_grad()
    def context_cache(self, features: torch.Tensor, positions: torch.Tensor) -> list:
        """Per-layer context keys/values ``[kv_heads, L, d]`` of the rows before the anchor, as a serving
        engine keeps them (each row's keys depend only on that row, so appending equals recomputing)."""
        ctx = self.context(features)
        cos_c, sin_c = self.rope(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos_c, sin_c) for layer in self.layers]

    def block_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., V]`` through the target's head: for a few rows only (eval, tests). One 2-D
        GEMM whatever ``hidden``'s layout: torch runs a strided ``[g, D, H]`` view (the draft slots of g
        blocks) times the head as g small batched GEMMs, 3.3x slower (g = 256, D = 7, H = 256, V = 8192,
        one thread; same values)."""
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.lm_head_weight.dtype)
        return (flat @ self.lm_head_weight.T).view(*hidden.shape[:-1], self.lm_head_weight.shape[0])


@functools.cache
def _spec_schema():
    """A pydantic model of ``DrafterSpec``'s fields (their annotations and defaults), for ``from_dict``."""
    from pydantic import ConfigDict, Field, create_model

    hints = typing.get_type_hints(DrafterSpec)
    fields = {}
    for f in dataclasses.fields(DrafterSpec):
        if f.default is not dataclasses.MISSING:
            fields[f.name] = (hints[f.name], f.default)
        elif f.default_factory is not dataclasses.MISSING:
            fields[f.name] = (hints[f.name], Field(default_factory=f.default_factory))
        else:
            fields[f.name] = (hints[f.name], ...)
    return create_model("DrafterSpecFields", __config__=ConfigDict(strict=True), **fields)
