"""The frozen target: hidden-state features for the drafter, never full-vocabulary logits.

``TargetModel`` runs a Hugging Face causal LM's transformer body only (``model.model``), captures the
outputs of the hooked decoder layers, and stops after the last hooked layer unless the teacher's
final-normed hidden states are wanted. The ``lm_head`` is never applied here; the loss projects the
few selected teacher rows itself (shared/DESIGN.md section 1, items 1-2).

Layer ids follow the z-lab convention: id ``l`` is the output of decoder layer ``l`` (HF's
``hidden_states[l + 1]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .anchors import doc_ids_from_positions
from .errors import UserError


def default_layer_ids(num_layers: int, k: int) -> list[int]:
    """z-lab's rule ``round(1 + i*(n-4)/(k-1))``, i = 0..k-1 (1, 16, 31, 46, 61 for n=64, k=5)."""
    if k < 1:
        raise UserError(f"number of target feature layers must be >= 1, got {k}")
    if num_layers < 4:
        raise UserError(f"the default layer-id rule needs a target with >= 4 layers, got {num_layers}")
    if k == 1:
        return [num_layers // 2]  # z-lab's rule for a single feature layer
    ids = [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]
    if len(set(ids)) != k:
        raise UserError(
            f"the default rule gives repeated layer ids {ids} for a {num_layers}-layer target and k={k}; "
            "set target.layer_ids explicitly"
        )
    return ids


class _StopForward(Exception):
    """Raised by the last needed hook to end the body's forward early."""


@dataclass
class TargetFeatures:
    """Features of one packed row of L tokens."""

    context: torch.Tensor  # [L, k*H] hooked layer outputs, concatenated in layer-id order
    last_hidden: torch.Tensor | None  # [L, H] final-normed hidden states (teacher input), or None


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if body is None or not isinstance(layers, nn.ModuleList):
        raise UserError(f"{type(model).__name__} has no decoder body with .layers; not a supported causal LM")
    return body, layers


class TargetModel:
    """A frozen causal LM that returns context features ``[L, k*H]`` and teacher hidden states ``[L, H]``."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None, num_feature_layers: int = 5):
        self.model = model.eval().requires_grad_(False)
        self.body, self.layers = _decoder_parts(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        ids = list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers, num_feature_layers)
        bad = [i for i in ids if not 0 <= i < self.num_layers]
        if bad:
            raise UserError(f"target layer ids {bad} are out of range for a {self.num_layers}-layer target (0..{self.num_layers - 1})")
        self.layer_ids = ids
        # Packing several documents in one row relies on the attention mask built from position ids;
        # recurrent (linear-attention) layers would carry state across documents, so such targets run
        # each document on its own.
        layer_types = getattr(config, "layer_types", None) or []
        self.packs_documents = all(t in ("full_attention", "sliding_attention") for t in layer_types)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` frozen output head (for the loss, which projects selected rows only)."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 need_teacher: bool = True) -> TargetFeatures:
        """Features of one packed row: ``input_ids`` ``[L]``, ``position_ids`` ``[L]`` restarting at 0 at
        each document start (default: one document). Documents never attend to each other."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be one packed row [L], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.numel(), device=input_ids.device)
        if self.packs_documents:
            return self._run(input_ids[None], position_ids[None], need_teacher)
        doc = doc_ids_from_positions(position_ids)
        starts = [0, *((doc[1:] != doc[:-1]).nonzero().squeeze(1) + 1).tolist()]
        bounds = [*starts[1:], input_ids.numel()]
        parts = [self._run(input_ids[None, s:e], position_ids[None, s:e], need_teacher) for s, e in zip(starts, bounds)]
        return TargetFeatures(
            torch.cat([p.context for p in parts]),
            torch.cat([p.last_hidden for p in parts]) if need_teacher else None,
        )

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, need_teacher: bool) -> TargetFeatures:
        captured: dict[int, torch.Tensor] = {}
        last_needed = max(self.layer_ids)

        def hook(index):
            def fn(_module, _args, output):
                captured[index] = (output[0] if isinstance(output, tuple) else output)[0]
                if not need_teacher and index == last_needed:
                    raise _StopForward

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.layer_ids))]
        last_hidden = None
        try:
            out = self.body(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            last_hidden = out.last_hidden_state[0]  # the body applies the final norm
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        context = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        return TargetFeatures(context, last_hidden)
