"""DSpark's two heads: the Markov logit bias and the confidence head (parameter names as speculators')."""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """``markov_w1`` (Embedding ``[V, r]``), ``markov_w2`` (Linear r -> V, weight ``[V, r]``), plus
    ``gate_proj`` (gated) or ``joint_proj`` (rnn); parameter names as speculators' ``MarkovHead``."""

    def __init__(self, vocab: int, rank: int, hidden: int, head_type: str):
        super().__init__()
        if head_type not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type must be vanilla, gated or rnn, got {head_type!r}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif head_type == "rnn":  # [gate; candidate; output] from [state; W1[prev]; hidden]
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def _rnn_step(self, state, emb, h):
        gate, cand, out = self.joint_proj(torch.cat([state, emb, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(cand)

    def features(self, prev_ids: torch.Tensor, hidden: torch.Tensor):
        """``prev_ids`` ``[nb, B]``, ``hidden`` ``[nb, B, H]`` -> (bias features f ``[nb, B, r]``, W1[prev] ``[nb, B, r]``)."""
        emb = self.markov_w1(prev_ids.long())
        hidden = hidden.to(emb.dtype)
        if self.head_type == "vanilla":
            return emb, emb
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, emb], dim=-1))) * emb, emb
        state, outs = emb.new_zeros(emb.shape[0], self.rank), []
        for k in range(emb.shape[1]):
            out, state = self._rnn_step(state, emb[:, k], hidden[:, k])
            outs.append(out)
        return torch.stack(outs, dim=1), emb


class ConfidenceHead(nn.Module):
    """``proj``: Linear(H (+ r), 1) -> the slot's acceptance logit."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)
