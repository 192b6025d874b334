"""Real speculative decoding, greedy or sampled: the target verifies the drafter's block as a chain or a DDTree.

One round, with the target's KV cache holding every accepted token before the anchor:

    anchor  = the target's last greedy token (not yet in the cache), at position P
    drafts  = drafter(anchor, context features of positions < P)          slots 1..B-1
    chain:  target forward over [anchor, d_1..d_{B-1}] at positions P..P+B-1
    ddtree: target forward over [anchor, tree nodes] at positions P + depth, each node attending to
            the cache, the anchor and its own ancestors only
    accept the longest draft path the target's greedy tokens agree with, plus the target's bonus
    token (the next anchor); crop (chain) or compact (tree) the KV cache to the accepted path, and
    keep the hooked hidden states of the accepted positions as the drafter's new context rows.

Cache handling per layer kind (full, sliding window, linear attention) lives in ``target_cache.py``:
sliding layers are cropped/compacted from the end, and recurrent (hybrid) targets are rolled back by
snapshot + replay, with trees verified as one chain per root-to-leaf path.

The output is token-for-token the target's plain greedy decoding (tested); tau = mean(accepted+1).
With a ``SampledVerification`` policy (``inference.sampling``) the target samples its token at every
verified position instead of taking its argmax, and the walk follows its samples: the output is then
distributed exactly as sampling from the target alone (tested statistically).
Batch size 1. The full-vocabulary head runs on verified positions only, never on the whole prompt.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..model.drafter import DFlashDrafter
from ..model.target import TargetModel
from ..variants import block_span, variant_of
from .ddtree import draft_tree
from .sampling import GreedyVerification
from .target_cache import TargetCache, root_to_leaf_paths


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (eos included when reached)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round
    anchors: list[int] = field(default_factory=list)  # anchor position of each round
    drafted: list[int] = field(default_factory=list)  # drafts proposed per round (the chain's length)
    seconds: float = 0.0
    rounds: list[VerifiedBlock] = field(default_factory=list)  # with generate(record=True): each round's block

    @property
    def tau(self) -> float:
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))


@dataclass
class VerifiedBlock:
    """One round as the target verified it (``generate(..., record=True)``): what the on-policy stage
    trains on. Chain: ``teacher`` row j is the target's final-normed hidden state at position
    ``anchor_pos + j``, after the anchor and drafts ``1..j`` (accepted or not): the state that predicts
    slot ``j + 1``, read from the verification pass itself (no extra target pass). DDTree: ``drafts``
    is the block's greedy chain (the tree's first candidate at every depth), ``accepted`` the length
    of the path the target accepted (its tokens are the text after the anchor, not always a prefix of
    ``drafts``), and no teacher (a tree node's state past the path follows a token the target rejected)."""

    anchor_pos: int
    drafts: list[int]  # [D] the block's greedy chain, D = B - 1
    accepted: int  # slots accepted (chain: a prefix of ``drafts``; DDTree: the accepted path's depth)
    teacher: torch.Tensor | None  # [D, H] (chain), None (DDTree)


@dataclass
class Prefilled:
    """A prompt run through the target once (``SpeculativeDecoder.prefill``): its target cache, the
    target's logits after its last token ``[1, V]`` and the drafter's context keys/values."""

    prompt_ids: list[int]
    cache: TargetCache
    logits: torch.Tensor
    drafter_cache: list


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter`` (chain or DDTree verification), greedy or sampled."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter, eos_ids: list[int], **propose_options):
        """``propose_options``: keywords of the variant's ``propose`` (DSpark: ``confidence_threshold``)."""
        self.target, self.drafter, self.eos = target, drafter.eval(), set(eos_ids)
        self.propose_options = propose_options
        self.model = target.model
        self._cache_kwarg = _forward_cache_kwarg(self.model)
        self.target_tokens = 0  # tokens the target has run (prompt, verifications, replays): the cost

    @torch.no_grad()
    def _forward(self, ids: list[int], positions: torch.Tensor, cache, mask=None, last_only=False):
        """Target forward of new tokens against ``cache``: logits ``[q, V]`` (or ``[1, V]``), the
        hooked layers' hidden states ``[q, k*H]`` and the final-normed hidden states ``[q, H]`` (a view
        of what the forward made: no copy, no compute)."""
        dev = self.model.device
        self.target_tokens += len(ids)
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=positions[None].to(dev),
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kwarg: cache},
        )
        feats = torch.cat([out.hidden_states[i + 1][0] for i in self.target.layer_ids], dim=-1)
        return out.logits[0], feats, out.hidden_states[-1][0]

    def _extend_context(self, drafter_cache, feats: torch.Tensor, start: int):
        """Append the drafter's keys/values of new context rows ``feats`` ``[n, k*H]`` at positions
        ``start..start+n-1``: a row's keys depend on that row only, so appending equals recomputing."""
        new = self.drafter.context_cache(feats, torch.arange(start, start + feats.shape[0], device=feats.device))
        if drafter_cache is None:
            return new
        return [(torch.cat([k, nk], dim=1), torch.cat([v, nv], dim=1)) for (k, v), (nk, nv) in zip(drafter_cache, new)]

    def _draft(self, anchor: int, anchor_pos: int, drafter_cache):
        """One block's proposal: ``(log_probs [D, V], greedy drafts [D], tree_of(budget) -> DraftTree)``
        from the drafter variant
        (DFlash: slots 1..B-1 at once; DSpark: the Markov walk). Logits carry the target's logit scale /
        softcap, as in training, so DDTree ranks prefixes by the same probabilities."""
        hidden = self.drafter.draft_block(anchor, anchor_pos, drafter_cache)
        variant = variant_of(self.drafter.spec)
        log_probs, drafts = variant.propose(self.drafter, hidden, anchor, **self.propose_options)
        depth = block_span(self.drafter.spec) - 1

        def tree_of(budget: int):
            """The block's DDTree (``ddtree.draft_tree``: node-conditioned for DSpark)."""
            return draft_tree(variant, self.drafter, hidden, anchor, lambda: log_probs, budget, depth)

        return log_probs, drafts, tree_of

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int]) -> Prefilled:
        """The prompt's target forward and drafter context, once: ``generate(..., prefilled=)`` decodes
        from copies of it, so that many samples of one prompt pay for its prefill once."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        cache = TargetCache(self.model)
        logits, context, _ = self._forward(prompt_ids, torch.arange(len(prompt_ids)), cache.cache, last_only=True)
        cache.commit(len(prompt_ids))
        return Prefilled(list(prompt_ids), cache, logits[-1:], self._extend_context(None, context, 0))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        mode: str = "chain",
        budget: int = 64,
        policy=None,
        prefilled: Prefilled | None = None,
        record: bool = False,
    ) -> DecodeResult:
        """Decode ``prompt_ids``; ``policy`` (``inference.sampling``) picks the target's tokens:
        greedy by default, ``SampledVerification(T, top_p, seed)`` for lossless speculative sampling.
        ``prefilled``: ``prefill(prompt_ids)``, decoded from a copy (it stays reusable). ``record``:
        every round's ``VerifiedBlock`` in ``result.rounds``."""
        policy = policy or GreedyVerification()
        if mode not in ("chain", "ddtree"):
            raise ValueError(f"mode must be 'chain' or 'ddtree', got {mode!r}")
        if budget < 1:
            raise ValueError(f"DDTree budget must be >= 1, got {budget}")
        if prefilled is not None and prefilled.prompt_ids != list(prompt_ids):
            raise ValueError("prefilled holds another prompt than prompt_ids")
        t0 = time.perf_counter()
        if prefilled is None:
            start = self.prefill(prompt_ids)
            cache = start.cache
        else:
            start = prefilled
            cache = copy.deepcopy(prefilled.cache)  # the prefill stays as it was, for the next decode
        drafter_cache = start.drafter_cache  # never written in place: each round concatenates anew
        pos = len(prompt_ids)  # == tokens in the target's cache == the anchor's position
        anchor = policy.rows(start.logits)(0, [])
        result = DecodeResult(tokens=[anchor])
        while len(result.tokens) < max_new_tokens and anchor not in self.eos:
            log_probs, drafts, tree_of = self._draft(anchor, pos, drafter_cache)
            result.drafted.append(len(drafts))
            verified = None
            if mode == "chain":
                accepted, bonus, feats, verified = self._verify_chain(anchor, pos, drafts, cache, policy)
            elif cache.recurrent:
                accepted, bonus, feats = self._verify_tree_paths(anchor, pos, tree_of(budget), cache, policy)
            else:
                accepted, bonus, feats = self._verify_tree(anchor, pos, tree_of(budget), cache, policy)
            if record:
                teacher = None if verified is None else verified[: len(drafts)].clone()
                result.rounds.append(VerifiedBlock(pos, list(drafts), len(accepted), teacher))
            drafter_cache = self._extend_context(drafter_cache, feats, pos)
            result.accepted.append(len(accepted))
            result.anchors.append(pos)
            result.tokens.extend(accepted + [bonus])
            anchor, pos = bonus, pos + len(accepted) + 1
        # stop at the first end-of-sequence token and at the length limit, exactly like plain greedy
        for i, tok in enumerate(result.tokens):
            if tok in self.eos:
                result.tokens = result.tokens[: i + 1]
                break
        result.tokens = result.tokens[:max_new_tokens]
        result.seconds = time.perf_counter() - t0
        return result

    def _verify_chain(self, anchor: int, pos: int, drafts: list[int], cache: TargetCache, policy=None):
        """``(accepted drafts, bonus token, context features of anchor + accepted [n+1, k*H], the
        verification pass's final hidden states [1 + D, H])``."""
        fed = [anchor, *drafts]
        cache.save()
        logits, feats, verified = self._forward(fed, torch.arange(pos, pos + len(fed)), cache.cache)
        # the target's token after position pos + i: its argmax, or its sample (policy)
        n, bonus = walk_chain(drafts, (policy or GreedyVerification()).rows(logits))
        if cache.keep_prefix(len(fed), n + 1):  # keep the anchor and the accepted drafts
            feats = self._replay(fed[: n + 1], pos, cache)
        return drafts[:n], bonus, feats[: n + 1], verified

    def _replay(self, tokens: list[int], pos: int, cache: TargetCache) -> torch.Tensor:
        """Run the accepted ``tokens`` on a rolled-back recurrent cache: their exact states and features."""
        _, feats, _ = self._forward(tokens, torch.arange(pos, pos + len(tokens)), cache.cache)
        cache.commit(len(tokens))
        return feats

    def _verify_tree(self, anchor: int, pos: int, tree, cache: TargetCache, policy=None):
        """One forward over the whole tree with an ancestor mask (attention-only targets)."""
        depths = torch.tensor([0, *tree.depths])
        mask = cache.tree_mask(pos, tree, self.model.dtype, self.model.device)
        logits, feats, _ = self._forward([anchor, *tree.tokens], pos + depths, cache.cache, mask=mask)
        # row 0: after the anchor; row 1 + i: after node i, under its ancestors
        path, nxt = walk_tree(tree, (policy or GreedyVerification()).rows(logits))
        cache.keep_tree_path(len(tree), path)
        return [tree.tokens[i] for i in path], nxt, feats[[0, *(1 + i for i in path)]]

    def _verify_tree_paths(self, anchor: int, pos: int, tree, cache: TargetCache, policy=None):
        """Recurrent (hybrid) targets: each root-to-leaf path verified as its own chain, all paths in one
        batch over copies of the state, so every node's logits are those of its path run alone; then the
        accepted tokens are replayed on the rolled-back state."""
        paths = root_to_leaf_paths(tree)
        width = 1 + max(len(p) for p in paths)
        # right padding never reaches a real token (causal), and the padded states are discarded
        rows = [[anchor, *(tree.tokens[i] for i in p)] + [anchor] * (width - 1 - len(p)) for p in paths]
        dev = self.model.device
        cache.save()
        cache.expand(len(paths))
        self.target_tokens += len(paths) * width
        out = self.model(
            input_ids=torch.tensor(rows, device=dev),
            position_ids=torch.arange(pos, pos + width, device=dev)[None].expand(len(paths), -1),
            use_cache=True,
            **{self._cache_kwarg: cache.cache},
        )
        cache.collapse(width)
        # row 0: after the anchor; row 1 + i: after node i on (the first of) its own path(s)
        rows_of = torch.zeros(1 + len(tree), dtype=torch.long)
        path_of = torch.zeros(1 + len(tree), dtype=torch.long)
        for p, nodes in reversed(list(enumerate(paths))):
            for depth, node in enumerate(nodes, start=1):
                path_of[1 + node], rows_of[1 + node] = p, depth
        logits = out.logits[path_of.to(dev), rows_of.to(dev)]  # [1 + nodes, V]
        path, nxt = walk_tree(tree, (policy or GreedyVerification()).rows(logits))
        feats = self._replay([anchor, *(tree.tokens[i] for i in path)], pos, cache)
        return [tree.tokens[i] for i in path], nxt, feats


def walk_chain(drafts: list[int], pick) -> tuple[int, int]:
    """Accept drafts while each equals the target's token at its position: ``pick(i, candidates)`` is
    the target's token after position ``pos + i`` (row i of the chain's verification logits).
    Returns ``(accepted, bonus)``."""
    n, token = 0, pick(0, drafts[:1])
    while n < len(drafts) and drafts[n] == token:
        n += 1
        token = pick(n, drafts[n : n + 1])
    return n, token


def walk_tree(tree, pick) -> tuple[list[int], int]:
    """Follow the target's tokens down ``tree``: ``pick(0, ...)`` is the target's token after the
    anchor, ``pick(1 + i, ...)`` after node i (under node i's ancestors). Returns ``(path, bonus)``,
    the accepted nodes and the first token no child matches."""
    children = tree.children()
    offspring: dict[int, list[int]] = {}
    for (parent, token), _ in children.items():
        offspring.setdefault(parent, []).append(token)
    node, path = -1, []
    token = pick(0, offspring.get(-1, []))
    while (node, token) in children:
        node = children[(node, token)]
        path.append(node)
        token = pick(1 + node, offspring.get(node, []))
    return path, token


@torch.no_grad()
def target_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int]) -> tuple[list[int], float]:
    """Plain greedy decoding with the target alone (Hugging Face ``generate``, KV cache): ``(tokens, seconds)``."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(eos_ids),
        pad_token_id=list(eos_ids)[0],
        top_k=None,
        top_p=None,
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    for i, tok in enumerate(tokens):
        if tok in set(eos_ids):
            tokens = tokens[: i + 1]
            break
    return tokens, time.perf_counter() - t0


@torch.no_grad()
def target_sample(
    model, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int], temperature: float, top_p: float, seed: int
) -> tuple[list[int], float]:
    """Plain sampling with the target alone (Hugging Face ``generate``, ``do_sample``, no top-k):
    ``(tokens, seconds)``; the baseline speculative sampling is timed against. Seeded through a
    forked global RNG, so the caller's random state is left alone."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt_ids], device=model.device)
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            eos_token_id=list(eos_ids),
            pad_token_id=list(eos_ids)[0],
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    for i, tok in enumerate(tokens):
        if tok in set(eos_ids):
            tokens = tokens[: i + 1]
            break
    return tokens, time.perf_counter() - t0


def _forward_cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version's forward takes."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
