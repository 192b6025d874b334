"""What the planner needs to know about a target and a GPU: shapes from a ``config.json``, built-in presets.

A target is described by the fields of its Hugging Face ``config.json`` (nested ``text_config`` for
multimodal checkpoints such as Qwen3.5/3.6). Parameter counts come from ``target_param_count``: the
model ``transformers`` builds from the config on the meta device (no memory), counted exactly, for
any family it can instantiate (MoE experts included); a formula over the fields (softmax attention with
optional output gate, Gated DeltaNet, SwiGLU MLP) is the fallback and the test's cross-check.

Mixture-of-experts targets (``num_experts`` / ``num_local_experts``): all experts are weights, but a
token's activations go through ``experts_per_tok`` experts of width ``moe_intermediate_size`` (plus a
shared expert), so activation memory is priced with ``mlp_active_width``, not with a dense width.

All sizes in this package are bytes; reports print decimal GB (1e9 bytes), the unit of DESIGN.md's
figures (32.5 GB of target logits, 12.2 GB per logits tensor).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config.gpus import GB, GPU_PRESETS, MIB, gpu_memory  # noqa: F401  (re-exported for the planner)
from ..errors import UserError

_QWEN36_27B = {
    # Qwen3.6-27B class (DESIGN.md section 1): the Qwen3.5-27B text stack, 64 layers, hidden 5120,
    # vocabulary 248,320; 3 of every 4 layers are Gated DeltaNet (linear attention), 1 is gated softmax
    # attention. 26.9 B parameters, 53.8 GB in bf16 (the vision tower is not loaded by the trainer).
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248_320,
    "tie_word_embeddings": False,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10_000_000, "partial_rotary_factor": 0.25},
}
_QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151_936,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000,
}
TARGET_PRESETS: dict[str, tuple[dict, str]] = {
    "qwen3.6-27b": (
        _QWEN36_27B,
        "Qwen3.6-27B class: 64 layers (48 linear + 16 gated attention), hidden 5120, vocab 248,320",
    ),
    "qwen3-8b": (_QWEN3_8B, "Qwen3-8B: 36 layers, hidden 4096, vocab 151,936"),
}

# model types whose mask ignores position restarts (TargetModel measures this at load and then runs
# each document alone; the planner, which loads no weights, prices that from this list)
_MASK_IGNORES_POSITIONS = ("gpt_oss",)

_REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")


@dataclass(frozen=True)
class TargetShape:
    """The shape of a target's text stack, as far as memory is concerned."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    attn_output_gate: bool = False  # q_proj also produces a sigmoid gate (Qwen3-Next / Qwen3.5 attention)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0  # 0 = dense MLP
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def mlp_active_width(self) -> int:
        """Width of the MLP activations one token makes: the dense width, or the routed experts' plus
        the shared expert's for an MoE target."""
        if not self.num_experts:
            return self.intermediate_size
        return self.experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size

    @property
    def num_full_attention(self) -> int:
        return sum(t != "linear_attention" for t in self.layer_types)

    @property
    def num_linear_attention(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def packs_documents(self) -> bool:
        """Mirrors ``TargetModel.packs_documents``: recurrent layers would leak state across documents,
        so such targets run each document of a packed row on its own."""
        if self.model_type in _MASK_IGNORES_POSITIONS:
            return False
        return all(t in ("full_attention", "sliding_attention") for t in self.layer_types)

    @classmethod
    def from_config(cls, config: dict, name: str) -> TargetShape:
        """From a ``config.json`` mapping (``text_config`` is used when present)."""
        if not isinstance(config, dict):
            raise UserError(f"{name}: config.json must hold a JSON object")
        c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        missing = [k for k in _REQUIRED if k not in c]
        if missing:
            raise UserError(
                f"{name}: config.json lacks {', '.join(repr(k) for k in missing)} "
                "(needed to plan memory; is this a causal LM's config?)"
            )
        for k in (*_REQUIRED, "num_key_value_heads", "head_dim"):
            v = c.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise UserError(f"{name}: config.json field '{k}' must be a positive integer, got {v!r}")
        n, heads = c["num_hidden_layers"], c["num_attention_heads"]
        types = c.get("layer_types")
        model_type = str(c.get("model_type", config.get("model_type", "unknown")))
        if types is None and ("linear_num_value_heads" in c or model_type.startswith(("qwen3_5", "qwen3_next"))):
            interval = c.get("full_attention_interval", 4)  # transformers' default rule for these models
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        types = tuple(types or ["full_attention"] * n)
        if len(types) != n:
            raise UserError(f"{name}: config.json has {len(types)} layer_types for {n} layers")
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        if not experts and "intermediate_size" not in c:
            raise UserError(
                f"{name}: config.json has neither 'intermediate_size' nor experts (is this a causal LM's config?)"
            )
        moe_width = (
            c.get("moe_intermediate_size") or c.get("intermediate_size") or 0
        )  # gpt-oss: experts of intermediate_size
        gated = bool(c.get("attn_output_gate", model_type.startswith(("qwen3_5", "qwen3_next"))))
        linear = "linear_attention" in types
        return cls(
            name=name,
            model_type=model_type,
            num_layers=n,
            hidden_size=c["hidden_size"],
            # MoE configs without a dense width (Qwen3.5-MoE): 3 x hidden, the ratio of Qwen3-30B-A3B's
            # dense intermediate_size (6144 = 3 x 2048); only the drafter default reads it (DrafterSpec)
            intermediate_size=c.get("intermediate_size") or 3 * c["hidden_size"],
            vocab_size=c["vocab_size"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            layer_types=types,
            attn_output_gate=gated,
            linear_num_key_heads=c.get("linear_num_key_heads", 16) if linear else 0,
            linear_num_value_heads=c.get("linear_num_value_heads", 32) if linear else 0,
            linear_key_head_dim=c.get("linear_key_head_dim", 128) if linear else 0,
            linear_value_head_dim=c.get("linear_value_head_dim", 128) if linear else 0,
            linear_conv_kernel_dim=c.get("linear_conv_kernel_dim", 4) if linear else 0,
            num_experts=experts,
            experts_per_tok=(c.get("num_experts_per_tok") or c.get("experts_per_token") or 1) if experts else 0,
            moe_intermediate_size=moe_width if experts else 0,
            shared_expert_intermediate_size=(c.get("shared_expert_intermediate_size") or 0) if experts else 0,
            config=dict(c),
        )


def load_target_shape(spec: str) -> TargetShape:
    """A target preset name, ``tiny``, a model folder or a ``config.json`` path -> its shape."""
    if spec in TARGET_PRESETS:
        return TargetShape.from_config(TARGET_PRESETS[spec][0], spec)
    if spec == "tiny":
        from ..tiny_target import TINY_TARGET_DIR

        path = TINY_TARGET_DIR / "config.json"
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "config.json"
    if not path.is_file():
        raise UserError(
            f"target {spec!r}: no config.json at {path} (give a model folder, a config.json, 'tiny', "
            f"or a built-in target: {', '.join(TARGET_PRESETS)})"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    return TargetShape.from_config(data, str(path))


# -- parameter counts ------------------------------------------------------------------------------


def full_attention_params(s: TargetShape) -> int:
    """q (x2 with the output gate), k, v, o projections and the per-head q/k norms of one attention layer."""
    q_out = s.num_heads * s.head_dim * (2 if s.attn_output_gate else 1)
    kv = s.num_kv_heads * s.head_dim
    return s.hidden_size * q_out + 2 * s.hidden_size * kv + s.num_heads * s.head_dim * s.hidden_size + 2 * s.head_dim


def linear_attention_params(s: TargetShape) -> int:
    """One Gated DeltaNet layer: in_proj_qkv, in_proj_z, in_proj_b/a, depthwise conv, A_log, dt_bias, gated norm, out_proj."""
    key_dim = s.linear_num_key_heads * s.linear_key_head_dim
    value_dim = s.linear_num_value_heads * s.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    nv, h = s.linear_num_value_heads, s.hidden_size
    return (
        h * conv_dim
        + h * value_dim
        + 2 * h * nv
        + conv_dim * s.linear_conv_kernel_dim
        + 2 * nv
        + s.linear_value_head_dim
        + value_dim * h
    )


def target_param_count(s: TargetShape) -> int:
    """Exact: the parameters of the model transformers builds from the config on the meta device;
    the dense formula when transformers cannot build it (unknown model type)."""
    counted = meta_param_count(json.dumps(s.config, sort_keys=True, default=str))
    return counted if counted is not None else formula_param_count(s)


@functools.lru_cache(maxsize=32)
def meta_param_count(config_json: str) -> int | None:
    """Parameters of ``AutoModelForCausalLM.from_config`` on the meta device (tied weights counted once),
    or None when transformers has no causal LM for this config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(json.loads(config_json))
    model_type = c.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **c)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an unknown or partial config: the formula is the answer
        return None
    return sum(p.numel() for p in model.parameters())


def formula_param_count(s: TargetShape) -> int:
    """Dense targets: embedding, lm_head (unless tied), every decoder layer (mixer + SwiGLU MLP + two
    norms), final norm."""
    h = s.hidden_size
    mlp = 3 * h * s.intermediate_size
    layers = sum(
        (linear_attention_params(s) if t == "linear_attention" else full_attention_params(s)) + mlp + 2 * h
        for t in s.layer_types
    )
    head = 0 if s.tie_word_embeddings else s.vocab_size * h
    return s.vocab_size * h + head + layers + h
