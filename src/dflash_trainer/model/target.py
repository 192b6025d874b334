"""The frozen target: hidden-state features for the drafter, never full-vocabulary logits.

``TargetModel`` runs a Hugging Face causal LM's transformer body only (``model.model``), captures the
outputs of the hooked decoder layers, and stops after the last hooked layer unless the teacher's
final-normed hidden states are wanted. The ``lm_head`` is never applied here; the loss projects the
few selected teacher rows itself (shared/DESIGN.md section 1, items 1-2).

Layer ids follow the z-lab convention: id ``l`` is the output of decoder layer ``l``, before the
final norm. That is Hugging Face's ``hidden_states[l + 1]`` for every layer but the last: for
``l = n - 1`` transformers returns the final-normed state there, which is what z-lab's code reads
(``export/semantics.py``: the zlab export refuses that id).

``row_features`` is the producer half of a training step: everything the drafter side needs for one
packed row, selected before it leaves the target (context features, teacher hidden states only at
the positions the blocks read, and the row's ids/positions/mask/anchors), as a plain tensor bundle
that can be sent between processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data.packing import document_spans
from ..errors import UserError


def text_config(config):
    """The language-model part of a Hugging Face config (multimodal folders nest it), else ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_logit_options(config) -> dict:
    """``{"logit_scale", "softcap"}`` of a Hugging Face model config: Cohere-style ``logit_scale``
    multiplies the logits, Gemma-style ``final_logit_softcapping`` caps them; both default to off."""
    text = text_config(config)
    scale = getattr(text, "logit_scale", None)
    softcap = getattr(text, "final_logit_softcapping", None)
    return {"logit_scale": float(scale) if scale else 1.0, "softcap": float(softcap) if softcap else None}


def embedding_scale(model) -> float:
    """The factor a model's input embedding multiplies looked-up rows by (Gemma: sqrt(hidden)), else 1.
    The drafter shares that module, so it trains on scaled rows; exports must carry the factor."""
    emb = model.get_input_embeddings()
    scale = getattr(emb, "scalar_embed_scale", None)
    if scale is None and isinstance(getattr(emb, "embed_scale", None), torch.Tensor) and not emb.embed_scale.is_meta:
        scale = emb.embed_scale.item()
    return float(scale) if scale is not None else 1.0


def config_embedding_scale(config) -> float:
    """``embedding_scale`` of the model a config describes, built on the meta device (no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text_config(config))
    return embedding_scale(model)


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """``layer_ids`` if every id is a decoder layer of an ``num_layers``-layer target, else one error."""
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise UserError(
            f"target layer ids {bad} are out of range for a {num_layers}-layer target (0..{num_layers - 1})"
        )
    return list(layer_ids)


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


def _packing_tolerance(dtype: torch.dtype) -> float:
    """Relative difference allowed between packed and per-document features: rounding only (a
    document that sees another differs by tens of percent)."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


class _StopForward(Exception):
    """Raised by the last needed hook to end the body's forward early."""


@dataclass
class TargetFeatures:
    """Features of one packed row of L tokens."""

    context: torch.Tensor  # [L, k*H] hooked layer outputs, concatenated in layer-id order
    last_hidden: torch.Tensor | None  # [L, H] final-normed hidden states (teacher input), or None


@dataclass
class RowFeatures:
    """What the drafter side needs of one packed row of L tokens with n sampled anchors (block size B).

    Only plain tensors, so the bundle can cross a process boundary as it is."""

    input_ids: torch.Tensor  # [L] long
    position_ids: torch.Tensor  # [L] long, restarting at 0 at each document start
    loss_mask: torch.Tensor  # [L] long
    anchors: torch.Tensor  # [n] long, sorted anchor positions
    context: torch.Tensor  # [L, k*H] hooked layer outputs (target dtype)
    teacher: torch.Tensor | None  # [n*B, H] final-normed hidden at anchor + j - 1 (j = 0..B-1), or None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}


def select_row_features(
    feats: TargetFeatures,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    need_teacher: bool,
) -> RowFeatures:
    """A row's ``RowFeatures`` from its full-row ``feats`` (computed now, or read from the feature
    cache): the teacher rows at ``anchor + j - 1`` (j = 0..B-1) only, ``[n*B, H]``."""
    teacher = None
    if need_teacher:
        j = torch.arange(block_size, device=anchors.device)
        index = (anchors[:, None] + j - 1).clamp(min=0).reshape(-1)  # [n*B]: anchor + j - 1
        teacher = feats.last_hidden[index.to(feats.last_hidden.device)]
    return RowFeatures(
        input_ids=input_ids,
        position_ids=position_ids,
        loss_mask=loss_mask,
        anchors=anchors,
        context=feats.context,
        teacher=teacher,
    )


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if body is None or not isinstance(layers, nn.ModuleList):
        raise UserError(f"{type(model).__name__} has no decoder body with .layers; not a supported causal LM")
    return body, layers


class TargetModel:
    """A frozen causal LM that returns context features ``[L, k*H]`` and teacher hidden states ``[L, H]``."""

    def __init__(
        self, model: nn.Module, layer_ids: list[int] | None = None, num_feature_layers: int = 5, *, body: bool = True
    ):
        """``body=False``: ``model`` holds only the embedding and head (``loading.load_target_head``, for
        training from cached features); its layers are dropped and ``features`` cannot run."""
        self.model = model.eval().requires_grad_(False)
        self.body, self.layers = _decoder_parts(model)
        config = text_config(model.config)
        self.config = config
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        ids = list(layer_ids) if layer_ids is not None else default_layer_ids(self.num_layers, num_feature_layers)
        self.layer_ids = check_layer_ids(ids, self.num_layers)
        if not body:
            self.keep_only("head")
            self.packing_error, self.packs_documents = None, False
            return
        # Packing several documents in one row relies on the model building its attention mask from
        # position restarts. Recurrent (linear-attention) layers would carry state across documents, and
        # some model classes ignore position_ids in their mask (gpt-oss), so this is measured, not assumed:
        # a synthetic packed row must give the per-document features, else every document runs alone.
        layer_types = getattr(config, "layer_types", None) or []
        attention_only = all(t in ("full_attention", "sliding_attention") for t in layer_types)
        self.packing_error = self._packing_error() if attention_only else None
        self.packs_documents = attention_only and self.packing_error <= _packing_tolerance(self.model.dtype)

    @torch.no_grad()
    def _packing_error(self, lengths: tuple[int, ...] = (13, 11)) -> float:
        """Max |packed - per-document| of the hooked features on a synthetic row of documents of
        ``lengths``, relative to the features' max magnitude."""
        dev = self.embed_tokens.weight.device
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (sum(lengths),), generator=gen).to(dev)
        pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        packed = self._run(ids[None], pos[None], need_teacher=True)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        alone = [self._run(ids[None, a:b], pos[None, a:b], need_teacher=True) for a, b in zip(starts, starts[1:])]
        ref = torch.cat([torch.cat([p.context, p.last_hidden], -1) for p in alone]).float()
        got = torch.cat([packed.context, packed.last_hidden], -1).float()
        return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))

    def keep_only(self, part: str) -> None:
        """Free what this process's role never uses: "body" drops the output head (a target rank runs
        the body only), "head" drops the decoder layers (a drafter rank needs the embedding and head)."""
        if part == "body":
            head = self.model.get_output_embeddings()
            if head is not None and head.weight is not self.embed_tokens.weight:  # a tied head is the embedding
                head.weight = nn.Parameter(head.weight.new_empty(0), requires_grad=False)
        elif part == "head":
            self.body.layers = nn.ModuleList()
            self.layers = self.body.layers
        else:
            raise ValueError(f"part must be 'body' or 'head', got {part!r}")

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` frozen output head (for the loss, which projects selected rows only)."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        """Where the target's weights are: rows go there for the forward, the drafter is built there."""
        return self.embed_tokens.weight.device

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, need_teacher: bool = True
    ) -> TargetFeatures:
        """Features of one packed row: ``input_ids`` ``[L]``, ``position_ids`` ``[L]`` restarting at 0 at
        each document start (default: one document). Documents never attend to each other."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be one packed row [L], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.numel(), device=input_ids.device)
        if self.packs_documents:
            return self._run(input_ids[None], position_ids[None], need_teacher)
        spans = document_spans(position_ids)
        parts = [self._run(input_ids[None, s:e], position_ids[None, s:e], need_teacher) for s, e in spans]
        return TargetFeatures(
            torch.cat([p.context for p in parts]),
            torch.cat([p.last_hidden for p in parts]) if need_teacher else None,
        )

    @torch.no_grad()
    def row_features(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        anchors: torch.Tensor,
        block_size: int,
        need_teacher: bool,
    ) -> RowFeatures:
        """The producer half of a step for one row (``[L]`` tensors) and its anchors ``[n]``: the
        teacher rows are gathered here, so only ``n*B`` of the ``L`` final hidden states leave."""
        feats = self.features(input_ids, position_ids, need_teacher=need_teacher)
        return select_row_features(feats, input_ids, position_ids, loss_mask, anchors, block_size, need_teacher)

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
