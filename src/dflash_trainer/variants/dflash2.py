"""DFlash2 (z-lab: the ``dflash`` package 0.1.0's ``DFlash2DraftModel``; speculators 0.9.0 ``models/dflash2``).

The DFlash backbone plus two pieces:

- **Local convolutions.** Around attention and around the MLP of every layer, a grouped dynamic
  causal convolution over the slots of a block (``GroupedDynamicCausalConv``): the sublayer's input
  ``x`` ``[T, H]`` becomes ``sum_t x[j - t] * (base_in[t] + dyn_in[j, t])`` and its output ``y``
  becomes ``sum_t y[j - t] * (base_out[t] + dyn_out[j, t])``, taps ``t < kernel``; ``base`` ``[2,
  kernel, H]`` is learned per channel, ``dyn`` ``[T, 2, kernel, H / group]`` is projected from the
  sublayer's input and shared by each group of ``group`` channels. The base kernel starts as the
  identity (tap 0 = 1) and the projection at zero, so an untrained DFlash2 computes exactly DFlash.
  A tap never reaches across a block boundary: the rows are viewed as ``[nb, B, H]`` and shifted
  inside each block, so the training layout (many blocks flattened into one dimension) equals the
  serving layout (one block) slot for slot.
- **Candidate selector** (``CandidateSelector``). The unary logits (the target's head over the
  drafter's hidden state, with its logit transform) pick the top K candidates of a slot; candidate
  ``c`` after predecessor ``t`` scores ``unary(c) + <pred[t] * (P h), succ[c]>`` (codebooks ``pred``,
  ``succ`` ``[V, r]``, ``P`` ``[r, H]``). At inference the walk starts at the anchor and each slot's
  predecessor is the token selected at the slot before: one drafter pass per block, only the
  selector walks. The draft distribution of a slot is the softmax of its K scores (zero elsewhere).

Slots as in DFlash: slot k of ``[anchor, MASK x (B-1)]`` predicts the token at ``anchor + k``
(k >= 1); its predecessor is the token at ``anchor + k - 1`` (the ground truth in training).

Training (speculators' split objective): the configured DFlash loss on the unary logits plus
``selector_alpha`` x a K-way cross-entropy over the unary top K, the label's position among them as
the class; where the label is not among the top K it replaces the weakest candidate. The top K come
out of the fused loss's chunk loop (``top_k``): the selector only ever sees ``[N, K]``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from ..config.variants import DFlash2Settings
from ..errors import UserError
from ..loss import LossTerms
from ..loss.logits import transform_logits
from ..model.drafter import DFlashDrafter, DrafterSpec
from .base import Variant

# speculators' DFlash2 config fields, by our names (the same names, z-lab's ``dflash_config`` too)
CONFIG_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` ``[T, H]`` (T a multiple of ``block``), ``dynamic`` ``[T, kernel, G]``, ``base`` ``[kernel, H]``
    -> ``[T, H]``: ``out[j] = sum_t x[j - t] * (base[t] + dynamic[j, t, group])`` over the taps with
    ``j - t`` in j's own block (slot ``j % block >= t``)."""
    t_rows, hidden = x.shape
    kernel, groups = base.shape[0], dynamic.shape[-1]
    blocks = x.view(t_rows // block, block, groups, hidden // groups)
    dyn = dynamic.view(t_rows // block, block, kernel, groups, 1)
    base = base.to(x.dtype).view(kernel, groups, hidden // groups)
    out = None
    for tap in range(kernel):
        # shift by ``tap`` slots inside each block: the first ``tap`` slots see zeros, never the block before
        term = _shift(blocks, tap) * (base[tap] + dyn[:, :, tap])
        out = term if out is None else out + term
    return out.view(t_rows, hidden)


def _shift(blocks: torch.Tensor, tap: int, forward: bool = True) -> torch.Tensor:
    """``[nb, B, ...]`` shifted by ``tap`` slots inside each block (zeros where the slot leaves it):
    ``forward`` moves slot j to j + tap (what slot j + tap reads), else slot j + tap to j."""
    if tap == 0:
        return blocks
    pad = [0, 0] * (blocks.dim() - 2)
    if forward:
        return F.pad(blocks[:, :-tap], (*pad, tap, 0))
    return F.pad(blocks[:, tap:], (*pad, 0, tap))


class _LeanConv(torch.autograd.Function):
    """``grouped_dynamic_conv`` keeping only its inputs for the backward pass: autograd through the
    plain formula saves a shifted copy and a coefficient tensor of ``[T, H]`` per tap, 4 x kernel of
    them per layer (about 20 GB at 24,576 slots x hidden 5120 x 5 layers in bf16); this saves the
    input (which the sublayer keeps anyway) and recomputes the taps. Tested equal in float64."""

    @staticmethod
    def forward(ctx, x, dynamic, base, block: int):
        ctx.save_for_backward(x, dynamic, base)
        ctx.block = block
        with torch.no_grad():
            return grouped_dynamic_conv(x, dynamic, base, block)

    @staticmethod
    def backward(ctx, grad_out):
        x, dynamic, base = ctx.saved_tensors
        t_rows, hidden = x.shape
        kernel, groups = base.shape[0], dynamic.shape[-1]
        view = (t_rows // ctx.block, ctx.block, groups, hidden // groups)
        xb, gb = x.view(view), grad_out.view(view)
        dyn = dynamic.view(*view[:2], kernel, groups, 1)
        base_b = base.to(x.dtype).view(kernel, groups, hidden // groups)
        dx = torch.zeros_like(xb)
        ddyn, dbase = torch.empty_like(dyn), torch.empty_like(base_b)
        for tap in range(kernel):
            # out[j] += x[j - tap] * coef[j, tap]: x[i] gets g[i + tap] * coef[i + tap, tap]
            dx += _shift(gb * (base_b[tap] + dyn[:, :, tap]), tap, forward=False)
            prod = gb * _shift(xb, tap)  # g[j] * x[j - tap]
            dbase[tap] = prod.sum((0, 1))
            ddyn[:, :, tap] = prod.sum(-1, keepdim=True)
        return dx.view(t_rows, hidden), ddyn.view_as(dynamic), dbase.view_as(base).to(base.dtype), None


class GroupedDynamicCausalConv(nn.Module):
    """``base_kernel`` ``[2, kernel, H]`` (input side, output side) and ``kernel_projection`` (H -> 2 x
    kernel x H / group, no bias), parameter names as z-lab's and speculators' checkpoints."""

    def __init__(self, hidden: int, block: int, kernel: int, group: int):
        super().__init__()
        self.block, self.kernel, self.groups = block, kernel, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        with torch.no_grad():  # the identity: an untrained DFlash2 layer is a DFlash layer
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor):
        """The sublayer's input ``[T, H]`` -> (convolved input, the output side's dynamic kernel)."""
        dyn = self.kernel_projection(x).view(x.shape[0], 2, self.kernel, self.groups)
        return _LeanConv.apply(x, dyn[:, 0], self.base_kernel[0], self.block), dyn[:, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output ``[T, H]`` convolved with the kernel ``prepare`` projected."""
        return _LeanConv.apply(y, dynamic, self.base_kernel[1], self.block)


class CandidateSelector(nn.Module):
    """``predecessor_codebook``, ``successor_codebook`` ``[V, r]`` and ``hidden_projection`` (H -> r)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def context(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` hidden and ``[...]`` predecessor ids -> ``pred[prev] * (P h)`` ``[..., r]``."""
        # F.embedding, not indexing: indexing's backward on CPU is index_put_ with atomic float adds on
        # more than one thread (run-to-run different sums); embedding's backward is deterministic.
        pred = F.embedding(prev.long(), self.predecessor_codebook)
        return pred * self.hidden_projection(hidden.to(pred.dtype))

    def transition(self, context: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``[..., r]`` context and ``[..., K]`` candidate ids -> ``<context, succ[c]>`` ``[..., K]``."""
        return torch.einsum("...r,...kr->...k", context, F.embedding(candidates.long(), self.successor_codebook))


def _options(spec: DrafterSpec) -> dict:
    return spec.variant_options


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Scores in fp32 (fp64 stays fp64), as the other variants' inference logits."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def selector_training_candidates(topk_ids: torch.Tensor, labels: torch.Tensor):
    """``[n, K]`` unary top-K ids and ``[n]`` labels -> (candidates ``[n, K]``, the label's position
    ``[n]``, label among the top K ``[n]`` bool): a label outside the top K replaces the weakest."""
    match = topk_ids == labels[:, None]
    inside = match.any(-1)
    k = topk_ids.shape[1]
    position = torch.where(inside, match.long().argmax(-1), torch.full_like(labels, k - 1))
    candidates = topk_ids.clone()
    candidates[:, -1] = torch.where(inside, candidates[:, -1], labels)
    return candidates, position, inside


class DFlash2Variant(Variant):
    name = "dflash2"
    speculators_type = "dflash2"
    speculators_non_causal_default = True  # DFlash2SpeculatorConfig's default (DFlash's is false)
    head_names = ("candidate_selector",)
    vocabulary_tables = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
    logged_metrics = ("selector_ce", "candidate_recall", "selector_accuracy")
    zlab_architecture = "DFlash2DraftModel"
    zlab_fields = CONFIG_FIELDS
    # z-lab's own save_pretrained writes its codebooks as nn.Embedding weights; speculators' (and this
    # project's export) as plain parameters, which z-lab's from_pretrained maps onto its embeddings
    key_aliases = {f"candidate_selector.{n}.weight": f"candidate_selector.{n}" for n in CODEBOOKS}

    def read_speculators_config(self, cfg: dict, where: str) -> dict:
        """The settings of a speculators ``dflash2`` config (or z-lab's ``dflash_config``); a missing field
        takes DFlash2's default; the training-only ``selector_alpha`` is the default."""
        if cfg.get("sample_from_anchor"):
            raise UserError(f"{where}: sample_from_anchor is true; a DFlash2 drafter drafts slots 1..B-1")
        given = {name: cfg[name] for name in CONFIG_FIELDS if cfg.get(name) is not None}
        try:
            return DFlash2Settings(**given).model_dump()
        except ValidationError as exc:
            err = exc.errors()[0]
            raise UserError(f"{where}: {err['loc'][0]} {err.get('input')!r}: {err['msg']}") from None

    def read_zlab_config(self, fields: dict, where: str) -> dict:
        """z-lab's ``DFlash2DraftModel`` reads all four fields with no default: each must be there."""
        missing = [name for name in CONFIG_FIELDS if fields.get(name) is None]
        if missing:
            raise UserError(
                f"{where}: a z-lab DFlash2DraftModel folder without dflash_config.{missing[0]} "
                "(z-lab's code requires conv_kernel_size, conv_group_size, selector_rank and selector_top_k)"
            )
        return self.read_speculators_config(fields, where)

    def _check(self, spec: DrafterSpec) -> dict:
        o = _options(spec)
        if spec.hidden_size % o["conv_group_size"]:
            raise UserError(
                f"drafter.dflash2.conv_group_size {o['conv_group_size']} must divide the hidden size {spec.hidden_size}"
            )
        if o["conv_kernel_size"] > spec.block_size:
            raise UserError(
                f"drafter.dflash2.conv_kernel_size {o['conv_kernel_size']} exceeds the block size {spec.block_size}"
            )
        if o["selector_top_k"] > spec.vocab_size:
            raise UserError(
                f"drafter.dflash2.selector_top_k {o['selector_top_k']} exceeds the vocabulary ({spec.vocab_size})"
            )
        return o

    def layer_modules(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        o = self._check(spec)
        make = lambda: GroupedDynamicCausalConv(  # noqa: E731
            spec.hidden_size, spec.block_size, o["conv_kernel_size"], o["conv_group_size"]
        )
        return {"attention_conv": make(), "mlp_conv": make()}

    def heads(self, spec: DrafterSpec) -> dict[str, nn.Module]:
        o = self._check(spec)
        selector = CandidateSelector(spec.vocab_size, spec.hidden_size, o["selector_rank"], o["selector_top_k"])
        return {"candidate_selector": selector}

    def head_shapes(self, options: dict, hidden: int, vocab: int) -> list[tuple[int, ...]]:
        r = options["selector_rank"]
        return [(vocab, r), (vocab, r), (r, hidden)]

    def layer_shapes(self, options: dict, hidden: int) -> list[tuple[int, ...]]:
        kernel, groups = options["conv_kernel_size"], hidden // options["conv_group_size"]
        conv = [(2, kernel, hidden), (2 * kernel * groups, hidden)]
        return conv + conv  # around attention, around the MLP

    def planner_terms(self, options: dict) -> dict:
        return {
            **super().planner_terms(options),
            "conv_kernel": options["conv_kernel_size"],
            "conv_group_size": options["conv_group_size"],
            "selector_rank": options["selector_rank"],
            "selector_top_k": options["selector_top_k"],
        }

    def export_refusal(self, fmt: str, spec: DrafterSpec) -> str | None:
        return None  # z-lab's layout (DFlash2DraftModel) and speculators' dflash2 both hold it

    def zlab_config(self, config: dict, spec: DrafterSpec) -> dict:
        """z-lab's ``DFlash2DraftModel`` layout: its class, and the four fields in ``dflash_config``. No
        ``auto_map``: the shipped ``modeling_dflash.py`` computes DFlash only (load it with z-lab's
        package, ``dflash.DFlash2DraftModel.from_pretrained``)."""
        o = _options(spec)
        rest = {k: v for k, v in config.items() if k != "auto_map"}
        dflash = {**config["dflash_config"], **{name: o[name] for name in CONFIG_FIELDS}}
        return {**rest, "architectures": ["DFlash2DraftModel"], "dflash_config": dflash}

    def speculators_config(self, config: dict, spec: DrafterSpec) -> dict:
        """speculators' ``DFlash2SpeculatorConfig``: the DFlash fields plus the convolution and selector sizes."""
        o = _options(spec)
        sc = dict(config["speculators_config"], algorithm="dflash2")
        return {
            **config,
            "speculators_model_type": "dflash2",
            "architectures": ["DFlash2DraftModel"],
            **{name: o[name] for name in CONFIG_FIELDS},
            "speculators_config": sc,
        }

    def batch_extras(self, spec: DrafterSpec, input_ids: torch.Tensor, anchors: torch.Tensor) -> dict:
        """``prev_ids`` ``[nb*B]``: slot k's predecessor, the row's token at ``anchor + k - 1`` (slot 0,
        which has no loss, reads the anchor)."""
        k = torch.arange(spec.block_size, device=anchors.device)
        idx = torch.maximum(anchors[:, None] + k - 1, anchors[:, None])
        return {"prev_ids": input_ids[idx].reshape(-1)}

    def loss(
        self, drafter: DFlashDrafter, hidden, teacher, head, batch, terms: LossTerms, options: dict, *, reference: bool
    ):
        o = _options(drafter.spec)
        if terms.label_source != "data":
            raise UserError(
                "drafter.variant dflash2 trains its selector on the data labels: set loss.label_source=data"
            )
        topk = replace(terms, top_k=o["selector_top_k"])
        loss, metrics = self.draft_loss(drafter, hidden, teacher, head, batch, topk, options, reference=reference)
        sel_loss, sel_metrics = self.selector_loss(drafter, hidden, head, batch, metrics["topk_ids"], terms)
        metrics.update(sel_metrics)
        return loss + o["selector_alpha"] * sel_loss.to(loss.dtype), metrics

    def selector_loss(self, drafter: DFlashDrafter, hidden, head, batch, topk_ids, terms: LossTerms):
        """The K-way cross-entropy of the selector over the rows with weight > 0 (``hidden`` ``[N, H]``,
        ``topk_ids`` ``[N, K]`` from the loss's chunk loop), as a weighted mean like the base loss's
        terms; metrics ``candidate_recall`` (label among the unary top K) and ``selector_accuracy``
        (the selector's argmax is the label, over the rows where it could be)."""
        from ..loss.candidates import candidate_logits

        rows = (batch.weights > 0).nonzero().squeeze(1)
        w = batch.weights[rows].to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        labels = batch.labels[rows]
        candidates, position, inside = selector_training_candidates(topk_ids[rows], labels)
        h = hidden[rows]
        unary = candidate_logits(h, head, candidates, terms.logit_scale, terms.softcap)
        selector = drafter.candidate_selector
        context = selector.context(h, batch.extras["prev_ids"][rows])
        scores = unary.to(w.dtype) + selector.transition(context, candidates).to(w.dtype)  # [n, K]
        ce = F.cross_entropy(scores, position, reduction="none")
        loss = (w * ce).sum() / w.sum().clamp(min=1e-12)
        with torch.no_grad():
            chosen = scores.argmax(-1) == position
            slots = batch.slots[rows]
            b = drafter.spec.block_size
            per_slot = lambda x: torch.zeros(b, dtype=torch.float64, device=x.device).index_add_(0, slots, x.double())  # noqa: E731
            metrics = {
                "selector_ce": loss.detach(),
                "candidate_recall": inside.double().mean() if rows.numel() else torch.zeros((), dtype=torch.float64),
                "selector_accuracy": (chosen & inside).double().sum() / inside.sum().clamp(min=1),
                "selector_per_slot": {
                    "rows": per_slot(torch.ones_like(inside, dtype=torch.float64)),
                    "recall": per_slot(inside),
                    "correct": per_slot(chosen & inside),
                },
            }
        return loss, metrics

    @torch.no_grad()
    def walk(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor):
        """Blocks ``hidden`` ``[g, B, H]`` with anchor tokens ``[g]`` -> (scores ``[g, D, V]``: each slot's
        selector scores at its K candidates, -inf elsewhere; the selected drafts ``[g, D]``), D = B - 1:
        slot by slot, each conditioned on the token selected before it (the anchor for slot 1)."""
        spec, selector = drafter.spec, drafter.candidate_selector
        unary = transform_logits(_upcast(drafter.block_logits(hidden[:, 1:])), **spec.logit_options)  # [g, D, V]
        top, cand = unary.topk(selector.top_k, dim=-1)  # [g, D, K]
        projected = selector.hidden_projection(hidden[:, 1:].to(selector.predecessor_codebook.dtype))  # [g, D, r]
        prev, drafts, rows = anchors.long(), [], []
        for k in range(cand.shape[1]):
            context = selector.predecessor_codebook[prev] * projected[:, k]
            scores = top[:, k] + selector.transition(context, cand[:, k]).to(top.dtype)  # [g, K]
            rows.append(scores)
            prev = cand[:, k].gather(1, scores.argmax(-1, keepdim=True)).squeeze(1)
            drafts.append(prev)
        scores = torch.stack(rows, 1)
        full = torch.full_like(unary, float("-inf")).scatter_(-1, cand, scores)
        return full, torch.stack(drafts, 1)

    def draft_logits(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchors: torch.Tensor, greedy: torch.Tensor):
        """``[g, D, V]``: the selector walk's scores (``walk``), already in the transformed space of the
        head's logits (their argmax is the walk's draft; -inf outside a slot's K candidates)."""
        return self.walk(drafter, hidden, anchors)[0]

    def candidate_hits(self, drafter: DFlashDrafter, draft_logits: torch.Tensor, greedy: torch.Tensor):
        """``[g, D]``: the target's token among the slot's K unary candidates, the finite entries of the
        walk's scores (``draft_logits``; the selector cannot draft another token)."""
        return torch.isfinite(draft_logits.gather(-1, greedy[..., None]).squeeze(-1))

    @torch.no_grad()
    def tree_expansion(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """DDTree children from the selector's distribution given the node's own token: depth j's
        children are slot j + 1's K candidates scored after that token (the anchor for the root)."""
        spec, selector = drafter.spec, drafter.candidate_selector
        unary = transform_logits(_upcast(drafter.block_logits(hidden[1:])), **spec.logit_options)  # [D, V]
        top, cand = unary.topk(selector.top_k, dim=-1)
        projected = selector.hidden_projection(hidden[1:].to(selector.predecessor_codebook.dtype))

        def step(k: int, prev: int):
            context = selector.predecessor_codebook[prev] * projected[k]
            scores = top[k] + selector.transition(context, cand[k]).to(top.dtype)
            out = torch.full_like(unary[k], float("-inf"))
            return out.scatter_(0, cand[k], torch.log_softmax(scores, -1)), None

        return step(0, anchor), lambda token, state, depth: step(depth, token)

    @torch.no_grad()
    def propose(self, drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int):
        """The selector walk over one block's hidden ``[B, H]``: ``(log_probs [B-1, V], drafts [B-1])``,
        each slot's distribution the softmax of its K scores given the draft before it."""
        scores, drafts = self.walk(drafter, hidden[None], torch.tensor([anchor], device=hidden.device))
        return torch.log_softmax(scores[0], dim=-1), drafts[0].tolist()
