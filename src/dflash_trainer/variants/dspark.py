"""DSpark (DeepSeek, arXiv 2607.05147; speculators 0.9.0 ``models/dspark`` is the reference).

The DFlash backbone plus two small heads:

- a Markov head: a rank-r logit bias from the previous token of the block, ``bias = W2 @ f``, with
  ``f = W1[prev]`` (vanilla), ``sigmoid(gate([h, W1[prev]])) * W1[prev]`` (gated) or the output of a
  recurrent state over the block (rnn); ``W1`` ``[V, r]`` an embedding over the target vocabulary,
  ``W2`` ``[V, r]``. In the loss it is a rank-r term of the same logits, folded into the fused loss's
  chunked GEMM (``bias_rows = f``, ``bias_weight = W2``): never ``[N, V]``.
- a confidence head: ``sigmoid(Linear([h, W1[prev]]))``, the slot's predicted acceptance, trained
  with BCE against the measured acceptance ``a = sum_v min(p_v, q_v)`` (detached), weight
  ``confidence_alpha``.

Which slot predicts which token (``sample_from_anchor``, the DSpark default, true):

    block           [anchor = x_P, MASK, ..., MASK]           slots k = 0..B-1 at positions P + k
    true:   slot k predicts x_{P+k+1}, prev token x_{P+k}     (B drafts; slot 0 predicts too)
    false:  slot k predicts x_{P+k},   prev token x_{P+k-1}   (k >= 1: B - 1 drafts, as DFlash)

In training ``prev`` is the ground-truth token (teacher forcing); at inference it is the token just
drafted (``propose`` walks the block slot by slot: one drafter pass, only the heads walk).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from ..config.variants import DSparkSettings
from ..errors import UserError
from ..loss import BlockCredit, LossTerms, PairTerm
from ..loss.logits import transform_logits
from ..model.drafter import DFlashDrafter, DrafterSpec
from .base import Variant


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


def _options(spec: DrafterSpec) -> dict:
    return spec.variant_options


class DSparkVariant(Variant):
    name = "dspark"
    speculators_type = "dspark"
    zlab_architecture = None  # z-lab's layout has no Markov or confidence head
    head_names = ("markov_head", "confidence_head")
    vocabulary_tables = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")

    def read_speculators_config(self, cfg: dict, where: str) -> dict:
        """The heads' settings of a speculators ``dspark`` config (``speculators_config`` above); a
        missing field takes DSpark's default. Training-only settings (loss weights) are DSpark's defaults."""
        fields = {
            "markov_rank": "markov_rank",
            "markov_head_type": "markov_head_type",
            "sample_from_anchor": "sample_from_anchor",
            "confidence_head": "enable_confidence_head",
            "confidence_head_with_markov": "confidence_head_with_markov",
        }
        given = {ours: cfg[theirs] for ours, theirs in fields.items() if cfg.get(theirs) is not None}
        try:
            return DSparkSettings(**given).model_dump()
        except ValidationError as exc:
            err = exc.errors()[0]
            name = fields.get(str(err["loc"][0]), err["loc"][0])
            raise UserError(f"{where}: {name} {err.get('input')!r}: {err['msg']}") from None

    def label_shift(self, spec: DrafterSpec) -> int:
        return 1 if _options(spec)["sample_from_anchor"] else 0

    def heads(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        o = _options(spec)
        out = {"markov_head": MarkovHead(spec.vocab_size, o["markov_rank"], spec.hidden_size, o["markov_head_type"])}
        if o["confidence_head"]:
            extra = o["markov_rank"] if o["confidence_head_with_markov"] else 0
            out["confidence_head"] = ConfidenceHead(spec.hidden_size + extra)
        return out

    def head_shapes(self, options: dict, hidden: int, vocab: int) -> list[tuple[int, ...]]:
        r = options["markov_rank"]
        shapes = [(vocab, r), (vocab, r)]  # W1, W2
        if options["markov_head_type"] == "gated":
            shapes += [(r, hidden + r), (r,)]
        elif options["markov_head_type"] == "rnn":
            shapes += [(3 * r, 2 * r + hidden), (3 * r,)]
        if options["confidence_head"]:
            shapes += [(1, hidden + (r if options["confidence_head_with_markov"] else 0)), (1,)]
        return shapes

    def planner_terms(self, options: dict) -> dict:
        return {
            **super().planner_terms(options),
            "label_shift": 1 if options["sample_from_anchor"] else 0,
            "bias_rank": options["markov_rank"],
            "per_row_terms": self.needs_teacher(options),
            "variant_teacher": self.needs_teacher(options),
        }

    def export_refusal(self, fmt: str, spec: DrafterSpec) -> str | None:
        if fmt != "speculators":
            return f"the {fmt} format has no Markov or confidence head: export a dspark drafter as speculators"
        return None

    def speculators_config(self, config: dict, spec: DrafterSpec) -> dict:
        """speculators' ``DSparkSpeculatorConfig`` (the ``dspark`` method vLLM serves): the DFlash fields
        plus the heads' settings; the weights keep speculators' names (``markov_head.markov_w1`` ...)."""
        o = _options(spec)
        drafts = spec.block_size if o["sample_from_anchor"] else spec.block_size - 1
        sc = dict(config["speculators_config"], algorithm="dspark")
        sc["proposal_methods"] = [{"proposal_type": "greedy", "speculative_tokens": drafts}]
        return {
            **config,
            "speculators_model_type": "dspark",
            "architectures": ["DSparkSpeculator"],
            "sample_from_anchor": o["sample_from_anchor"],
            "markov_rank": o["markov_rank"],
            "markov_head_type": o["markov_head_type"],
            "enable_confidence_head": o["confidence_head"],
            "confidence_head_with_markov": o["confidence_head_with_markov"] and o["confidence_head"],
            "speculators_config": sc,
        }

    def needs_teacher(self, options: dict) -> bool:
        o = options
        return o["confidence_head"] or o["renyi_weight"] > 0 or o["position_weights"] == "dpard"

    def batch_extras(self, spec: DrafterSpec, input_ids: torch.Tensor, anchors: torch.Tensor) -> dict:
        """``prev_ids`` ``[nb*B]``: slot k's previous token, the row's token at ``anchor + k + shift - 1``
        (never before the anchor: slot 0 without sample_from_anchor has no loss and reads the anchor)."""
        b, shift = spec.block_size, self.label_shift(spec)
        k = torch.arange(b, device=anchors.device)
        idx = torch.maximum(anchors[:, None] + k + shift - 1, anchors[:, None])
        return {"prev_ids": input_ids[idx].reshape(-1)}

    def head_inputs(self, drafter: DFlashDrafter, prev_ids: torch.Tensor, hidden: torch.Tensor):
        """``(bias features f [N, r], confidence logits [N] or None)`` of rows ``[N, H]`` in blocks of B."""
        b = drafter.spec.block_size
        n, h = hidden.shape
        feat, emb = drafter.markov_head.features(prev_ids.view(-1, b), hidden.view(-1, b, h))
        conf = None
        if hasattr(drafter, "confidence_head"):
            x = hidden.to(emb.dtype)
            if _options(drafter.spec)["confidence_head_with_markov"]:
                x = torch.cat([x, emb.reshape(n, -1)], dim=-1)
            conf = drafter.confidence_head(x)
        return feat.reshape(n, -1), conf

    def loss(
        self, drafter: DFlashDrafter, hidden, teacher, head, batch, terms: LossTerms, options: dict, *, reference: bool
    ):
        o, spec = _options(drafter.spec), drafter.spec
        b = spec.block_size
        feat, conf = self.head_inputs(drafter, batch.extras["prev_ids"], hidden)
        dpard = o["position_weights"] == "dpard"
        if self.needs_teacher(o):  # acceptance a = the overlap, Renyi-1/2 (weighted by renyi_weight), D-PARD
            own = (PairTerm("accept", "overlap"), PairTerm("renyi", "renyi_half", weight=o["renyi_weight"]))
            credit = BlockCredit("overlap", o["dpard_alpha"]) if dpard else terms.credit
            terms = replace(terms, pair_terms=own + terms.pair_terms, credit=credit)
        loss, metrics = self.draft_loss(
            drafter,
            hidden,
            teacher,
            head,
            batch,
            terms,
            options,
            reference=reference,
            bias_rows=feat.to(head.dtype),
            bias_weight=drafter.markov_head.markov_w2.weight.to(head.dtype),
        )
        if conf is not None:
            # BCE against the measured acceptance, detached, on the fixed slot weights (as speculators:
            # D-PARD's credit is for the token terms), as a weighted mean like the other terms.
            accept = metrics["overlap_rows"].detach().to(conf.dtype)
            w = batch.weights.to(conf.dtype)
            bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
            conf_loss = (w * bce).sum() / w.sum().clamp(min=1e-12)
            loss = loss + o["confidence_alpha"] * conf_loss.to(loss.dtype)
            with torch.no_grad():
                keep = w > 0
                metrics["confidence_bce"] = conf_loss.detach()
                metrics["confidence_pred"] = conf.sigmoid()[keep].mean() if keep.any() else conf.new_zeros(())
                # calibration per slot: predicted vs measured acceptance, summed over rows with loss
                slots = batch.slots[keep]
                metrics["confidence_per_slot"] = {
                    "rows": torch.zeros(b, dtype=torch.float64, device=conf.device).index_add_(
                        0, slots, torch.ones_like(slots, dtype=torch.float64)
                    ),
                    "predicted": torch.zeros(b, dtype=torch.float64, device=conf.device).index_add_(
                        0, slots, conf.sigmoid()[keep].double()
                    ),
                    "measured": torch.zeros(b, dtype=torch.float64, device=conf.device).index_add_(
                        0, slots, accept[keep].double()
                    ),
                }
                metrics["confidence_abs_error"] = (
                    (conf.sigmoid() - accept).abs()[keep].mean() if keep.any() else conf.new_zeros(())
                )
        return loss, metrics

    def draft_logits(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor):
        """``[g, D, V]``: the Markov walk's logits, each slot biased by the walk's own (argmax) draft
        before it, the anchor for the first: exactly what ``propose`` drafts. Teacher-forced chain
        acceptance is the same as conditioning on the target's greedy tokens (the chain stops at the
        first mismatch), and the sampled chain is the drafts decoding really verifies."""
        return self.walk(drafter, hidden, anchors)[0]

    def draft_confidence(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor):
        """``[g, D]``: the confidence head's sigmoid along the Markov walk (None without the head)."""
        return self.walk(drafter, hidden, anchors)[2]

    @torch.no_grad()
    def walk(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor):
        """Blocks ``hidden`` ``[g, B, H]`` with anchor tokens ``[g]`` -> (raw logits ``[g, D, V]``, drafts
        ``[g, D]``, confidence ``[g, D]`` or None): slot by slot, one small GEMM per slot, only the heads walk."""
        spec, head, w_head = drafter.spec, drafter.markov_head, drafter.lm_head_weight
        g, b, _ = hidden.shape
        shift = self.label_shift(spec)
        seq = [anchors.long()]  # tokens at anchor + 0, 1, ...
        state = hidden.new_zeros(g, head.rank, dtype=head.markov_w1.weight.dtype)
        logits, confs = [], []
        with_markov = _options(spec)["confidence_head_with_markov"]
        for k in range(b):
            emb = head.markov_w1(seq[max(0, k + shift - 1)])  # [g, r]
            h = hidden[:, k].to(emb.dtype)
            if head.head_type == "vanilla":
                feat = emb
            elif head.head_type == "gated":
                feat = torch.sigmoid(head.gate_proj(torch.cat([h, emb], dim=-1))) * emb
            else:
                feat, state = head._rnn_step(state, emb, h)
            if k < 1 - shift:  # slot 0 without sample_from_anchor: no draft (it only advances the rnn state)
                continue
            z = hidden[:, k].to(w_head.dtype) @ w_head.T + (feat @ head.markov_w2.weight.T).to(w_head.dtype)
            logits.append(z)
            seq.append(z.argmax(-1))
            if hasattr(drafter, "confidence_head"):
                confs.append(torch.sigmoid(drafter.confidence_head(torch.cat([h, emb], -1) if with_markov else h)))
        conf = torch.stack(confs, 1) if confs else None
        return torch.stack(logits, 1), torch.stack(seq[1:], 1), conf

    @torch.no_grad()
    def tree_expansion(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """DDTree children from the distribution conditioned on the node's own token: depth j's draft is
        slot ``j - shift``'s head logits plus the Markov bias of the token at depth j - 1 (the anchor at
        depth 1); the rnn head's state follows the node's path."""
        spec, head, w_head = drafter.spec, drafter.markov_head, drafter.lm_head_weight
        shift = self.label_shift(spec)
        slot_logits = {}  # k -> hidden[k] @ W^T [V]: the same for every node at depth k, so computed once

        def step(k: int, prev: int, state):
            emb = head.markov_w1.weight[prev]
            h = hidden[k].to(emb.dtype)
            if head.head_type == "vanilla":
                feat = emb
            elif head.head_type == "gated":
                feat = torch.sigmoid(head.gate_proj(torch.cat([h, emb]))) * emb
            else:
                feat, state = head._rnn_step(state, emb, h)
            if k not in slot_logits:
                slot_logits[k] = hidden[k].to(w_head.dtype) @ w_head.T
            raw = slot_logits[k] + (head.markov_w2.weight @ feat).to(w_head.dtype)
            return torch.log_softmax(transform_logits(raw.float(), **spec.logit_options), dim=-1), state

        state = hidden.new_zeros(head.rank, dtype=head.markov_w1.weight.dtype)
        if shift == 0:  # slot 0 drafts nothing; it only advances the rnn state (prev = the anchor)
            _, state = step(0, anchor, state)
        root = step(1 - shift, anchor, state)

        def expand(token: int, state, depth: int):
            return step(depth + 1 - shift, token, state)  # the children of a node at ``depth``

        return root, expand

    @torch.no_grad()
    def propose(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int, confidence_threshold: float = 0.0):
        """The Markov walk over one block's hidden ``[B, H]``: ``(log_probs [D, V], drafts [D])``, D = B
        (sample_from_anchor) or B - 1, each row conditioned on the greedy drafts before it. With
        ``confidence_threshold`` > 0 the chain stops before the first slot at which the confidence
        head's cumulative predicted acceptance falls below it (at least one draft is kept)."""
        anchors = torch.tensor([anchor], device=hidden.device)
        logits, drafts, conf = self.walk(drafter, hidden[None], anchors)
        log_probs = torch.log_softmax(transform_logits(logits[0].float(), **drafter.spec.logit_options), dim=-1)
        drafts = drafts[0].tolist()
        if confidence_threshold > 0 and conf is not None:
            below = (torch.cumprod(conf[0].double(), 0) < confidence_threshold).nonzero()
            keep = max(1, int(below[0]) if below.numel() else len(drafts))
            log_probs, drafts = log_probs[:keep], drafts[:keep]
        return log_probs, drafts
