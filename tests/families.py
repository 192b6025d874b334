"""Tiny random-initialised targets of the families users train for, saved as Hugging Face folders
with the embedded tiny target's tokenizer (its vocabulary and ``<|MASK|>``).

Four decoder layers, hidden 64; sliding windows of 24 tokens so that decoding runs past them; hybrid
targets have three Gated DeltaNet layers and one full-attention layer, like Qwen3.5 / Qwen3-Next.
Weights are drawn with a large ``initializer_range`` so that greedy decoding does not collapse into
repeating one token (which would make "equal to greedy" an easy test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

WINDOW = 24
_COMMON = dict(
    vocab_size=8192,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    initializer_range=0.5,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=None,
)
_LINEAR = dict(
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: dict[str, dict] = {
    "qwen3": dict(model_type="qwen3", intermediate_size=128),
    "llama": dict(model_type="llama", intermediate_size=128),
    "mistral": dict(model_type="mistral", intermediate_size=128, sliding_window=WINDOW),
    "gemma3": dict(
        model_type="gemma3_text",
        intermediate_size=128,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
        tie_word_embeddings=False,  # Gemma scales input embeddings by sqrt(hidden): tied, greedy echoes the input
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        intermediate_size=128,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen3_5": dict(model_type="qwen3_5_text", intermediate_size=128, **_LINEAR),
    "qwen3_next": dict(
        model_type="qwen3_next", intermediate_size=128, shared_expert_intermediate_size=32, **_LINEAR, **_MOE
    ),
    # like the published Qwen3.5-MoE configs: no intermediate_size at all
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", shared_expert_intermediate_size=32, **_LINEAR, **_MOE),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=128, **_MOE),
}
HYBRID = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
SLIDING = ("mistral", "gemma3", "gpt_oss")
MOE = ("gpt_oss", "qwen3_next", "qwen3_5_moe", "qwen3_moe")


def family_config(name: str):
    from transformers import AutoConfig

    kw = {**_COMMON, **FAMILIES[name]}
    model_type = kw.pop("model_type")
    config = AutoConfig.for_model(model_type, **kw)
    if name == "qwen3_5_moe" and hasattr(config, "intermediate_size"):
        del config.intermediate_size
    return config


def build_family(name: str, folder: Path | None = None, seed: int = 0):
    """The tiny random model of family ``name`` (fp32, eval); saved with the tiny tokenizer into ``folder``."""
    from transformers import AutoModelForCausalLM

    from dflash_trainer.tiny_target import tiny_target_path

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(name), dtype=torch.float32).eval()
    if folder is not None:
        model.save_pretrained(folder)
        src = tiny_target_path()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(src / f, Path(folder) / f)
    return model
