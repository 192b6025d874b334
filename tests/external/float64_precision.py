"""Imported by the parity scripts of this folder before they build a model, in the writer's venv.

transformers' Qwen3 modules, which speculators', z-lab's and SpecForge's drafters all use, compute three
things in float32 whatever the model's dtype: ``Qwen3RMSNorm`` normalizes in float32
(``hidden_states.to(torch.float32)``), ``Qwen3RotaryEmbedding`` builds its cos/sin tables from float32
frequencies and angles, and the eager attention takes its softmax with ``dtype=torch.float32``. A parity check runs both implementations in float64 so that their
difference is bounded by float64's rounding alone (tests/tolerances.py ``float64_forward_error``); for a
float64 input these compute the same formulas in float64, as this project's drafter does:
``weight * (x * rsqrt(mean(x^2) + eps))``, ``cos/sin(position * theta^(-2i/d))`` for the default
RoPE, and a softmax asked to upcast a float64 input to float32 stays in float64. Every other dtype (and any other RoPE type) goes to transformers' own forward unchanged: the
writer's network is the same, only its precision is raised. Nothing from dflash_trainer is imported.
"""

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

if not hasattr(Qwen3RMSNorm, "float32_forward"):  # the long-lived interpreter imports this once per script
    Qwen3RMSNorm.float32_forward = Qwen3RMSNorm.forward
    Qwen3RotaryEmbedding.float32_forward = Qwen3RotaryEmbedding.forward
    torch.nn.functional.float32_softmax = torch.nn.functional.softmax


def _norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != torch.float64:
        return self.float32_forward(hidden_states)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or config.rope_theta)


@torch.no_grad()
def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor):
    if x.dtype != torch.float64 or self.rope_type != "default":
        return self.float32_forward(x, position_ids)
    dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
    inv_freq = 1.0 / (_rope_theta(self.config) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = position_ids[..., None].to(torch.float64) * inv_freq.to(x.device)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _softmax(input, dim=None, _stacklevel=3, dtype=None):
    if input.dtype == torch.float64 and dtype == torch.float32:
        dtype = torch.float64  # an "upcast" of a float64 input would round it to float32
    return torch.nn.functional.float32_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


Qwen3RMSNorm.forward = _norm
Qwen3RotaryEmbedding.forward = _rotary
torch.nn.functional.softmax = _softmax
