"""DFlash draft model for ``trust_remote_code`` loading (written by dflash-trainer's zlab export).

Self-contained: torch and transformers only. Loads the exported folder with

    model = AutoModel.from_pretrained(folder, trust_remote_code=True)

Inputs of ``forward`` (batch 1, z-lab's layout): ``noise_embedding`` ``[1, Q, H]`` (the target's
embedding of ``[anchor, MASK x (B-1)]`` for each block), ``target_hidden`` ``[1, L, k*H]`` (the
concatenated hidden states of ``dflash_config.target_layer_ids``, id l = output of target decoder
layer l), ``position_ids`` ``[1, L + Q]`` (context positions, then block positions), and an optional
boolean ``attention_mask`` ``[Q, L + Q]`` (True = may attend; default: every key). Returns the
final-normed hidden states ``[1, Q, H]``; the target's own ``lm_head`` turns them into logits.
Context rows are keys and values only (KV injection through each layer's k_proj/v_proj).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # fp32 at least; float64 stays float64
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _scaled_inv_freq(inv_freq, head_dim, theta, rope):
    """``(inv_freq, cos/sin scale)`` of a linear or YaRN ``rope_parameters`` (transformers' definitions)."""
    kind, factor = rope.get("rope_type", "default"), float(rope.get("factor") or 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind != "yarn":
        return inv_freq, 1.0
    original = float(rope["original_max_position_embeddings"])

    def boundary(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = boundary(float(rope.get("beta_fast") or 32)), boundary(float(rope.get("beta_slow") or 1))
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    scale = rope.get("attention_factor")
    scale = float(scale) if scale is not None else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp, scale


def _rope(positions, head_dim, theta, dtype, rope=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    inv_freq, scale = _scaled_inv_freq(inv_freq, head_dim, theta, rope or {})
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask):
        n_ctx, n_q, d = context.shape[0], x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(n_q, self.heads, d)).transpose(0, 1)
        kv_in = torch.cat([context, x], dim=0)
        k = self.k_norm(self.k_proj(kv_in).view(n_ctx + n_q, self.kv_heads, d)).transpose(0, 1)
        v = self.v_proj(kv_in).view(n_ctx + n_q, self.kv_heads, d).transpose(0, 1)
        q = _rotate(q, cos[n_ctx:], sin[n_ctx:])
        k = _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
        return self.o_proj(out[0].transpose(0, 1).reshape(n_q, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config):
        super().__init__(config)
        k = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(k * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_size = config.block_size
        self.mask_token_id = config.dflash_config["mask_token_id"]
        self.post_init()

    def _rope_theta(self):
        rope = getattr(self.config, "rope_parameters", None) or {}
        return float(rope.get("rope_theta") or getattr(self.config, "rope_theta", 1e6))

    def forward(self, noise_embedding, target_hidden, position_ids, attention_mask=None):
        x = noise_embedding[0].to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden[0].to(self.fc.weight.dtype)))
        n_ctx = context.shape[0]
        head_dim = self.layers[0].self_attn.head_dim
        rope = getattr(self.config, "rope_parameters", None) or {}
        cos, sin = _rope(position_ids[0], head_dim, self._rope_theta(), x.dtype, rope)
        layer_types = getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        causal_sliding = bool(self.config.dflash_config.get("causal_in_block_sliding", False))
        for layer, kind in zip(self.layers, layer_types):
            mask = attention_mask
            if kind == "sliding_attention":
                mask = self._sliding_mask(attention_mask, n_ctx, x.shape[0], causal_sliding, x.device)
            x = layer(x, context, cos, sin, mask)
        return self.norm(x)[None]

    def _sliding_mask(self, mask, n_ctx, n_q, causal, device):
        """The last ``sliding_window`` context rows (for a single block, as served), optionally causal
        inside the block; combined with a caller's mask when one is given."""
        allowed = torch.ones(n_q, n_ctx + n_q, dtype=torch.bool, device=device)
        allowed[:, : max(0, n_ctx - self.config.sliding_window)] = False
        if causal:
            allowed[:, n_ctx:] = torch.ones(n_q, n_q, dtype=torch.bool, device=device).tril()
        return allowed if mask is None else (mask & allowed)
