"""DDTree: the ``budget`` most probable draft prefixes of one block, as a tree (DESIGN.md section 2).

A block gives per-slot distributions ``p_1..p_D`` over the vocabulary (slots 1..B-1, D = B-1). A
prefix ``(x_1..x_d)`` has probability ``prod_j p_j(x_j)`` (product of marginals). Because every factor
is at most 1, a prefix is never more probable than its parent, so the ``budget`` most probable
prefixes form a tree rooted at the anchor. They are enumerated best-first with a heap over per-depth
top-k lists: popping a node pushes its next sibling (same depth, next rank) and its first child
(next depth, rank 0), so each pop yields the next most probable prefix.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """Nodes in best-first order (every parent precedes its children). Node i has token
    ``tokens[i]``, depth ``depths[i]`` (1 = first draft slot) and parent ``parents[i]`` (-1 = anchor)."""

    tokens: list[int]
    depths: list[int]
    parents: list[int]
    logprobs: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[tuple[int, int], int]:
        """``(parent, token) -> node`` for walking the tree along a token path."""
        return {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}

    def ancestor_mask(self) -> torch.Tensor:
        """``[n, n]`` bool: node i may attend to node j iff j is i or an ancestor of i."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = self.parents[j]
        return mask


def build_tree(log_probs: torch.Tensor, budget: int) -> DraftTree:
    """The ``budget`` most probable prefixes of ``log_probs`` ``[D, V]`` (slots 1..B-1)."""
    if budget < 1:
        raise ValueError(f"DDTree budget must be >= 1, got {budget}")
    depth_max = log_probs.shape[0]
    k = min(budget, log_probs.shape[1])
    top_lp, top_tok = log_probs.double().topk(k, dim=-1)  # [D, k], sorted
    top_lp, top_tok = top_lp.tolist(), top_tok.tolist()
    tree = DraftTree([], [], [], [])
    # heap entries: (-logprob, tie-break counter, depth index, rank, parent node, parent logprob)
    heap = [(-top_lp[0][0], 0, 0, 0, -1, 0.0)]
    counter = 1
    while heap and len(tree) < budget:
        neg, _, d, r, parent, parent_lp = heapq.heappop(heap)
        node = len(tree)
        tree.tokens.append(top_tok[d][r])
        tree.depths.append(d + 1)
        tree.parents.append(parent)
        tree.logprobs.append(-neg)
        if r + 1 < k:  # next sibling: same parent, next-ranked token at this depth
            heapq.heappush(heap, (-(parent_lp + top_lp[d][r + 1]), counter, d, r + 1, parent, parent_lp))
            counter += 1
        if d + 1 < depth_max:  # first child: best token at the next depth
            heapq.heappush(heap, (-(-neg + top_lp[d + 1][0]), counter, d + 1, 0, node, -neg))
            counter += 1
    return tree


def build_conditioned_tree(root, expand, depth_max: int, budget: int) -> DraftTree:
    """The ``budget`` most probable prefixes when a slot's distribution depends on the drafts before
    it (DSpark's Markov head): ``root = (log_probs [V], state)`` of depth 1, ``expand(token, state,
    depth) -> (log_probs [V], state)`` the children's distribution of a node at ``depth`` with that
    token. Conditional probabilities are at most 1, so a prefix is never more probable than its
    parent and best-first order still yields a tree; each node added costs one ``expand``."""
    if budget < 1:
        raise ValueError(f"DDTree budget must be >= 1, got {budget}")
    tree = DraftTree([], [], [], [])
    lists = {}  # parent node -> (top log-probs, top tokens, state after the parent's step)

    def top(entry):
        lp, state = entry
        k = min(budget, lp.shape[0])
        values, tokens = lp.double().topk(k)
        finite = values > float("-inf")  # a distribution over K candidates (DFlash2): never a 0-probability child
        return values[finite].tolist(), tokens[finite].tolist(), state

    lists[-1] = top(root)
    heap = [(-lists[-1][0][0], 0, -1, 0, 0.0, 1)]  # (-logprob, counter, parent, rank, parent logprob, depth)
    counter = 1
    while heap and len(tree) < budget:
        neg, _, parent, rank, parent_lp, depth = heapq.heappop(heap)
        lps, toks, state = lists[parent]
        node = len(tree)
        tree.tokens.append(toks[rank])
        tree.depths.append(depth)
        tree.parents.append(parent)
        tree.logprobs.append(-neg)
        if rank + 1 < len(lps):  # next sibling
            heapq.heappush(heap, (-(parent_lp + lps[rank + 1]), counter, parent, rank + 1, parent_lp, depth))
            counter += 1
        if depth < depth_max:  # first child, from the distribution conditioned on this node's token
            lists[node] = top(expand(toks[rank], state, depth))
            heapq.heappush(heap, (-(-neg + lists[node][0][0]), counter, node, 0, -neg, depth + 1))
            counter += 1
    return tree


def accepted_in_tree(tree: DraftTree, greedy: list[int]) -> int:
    """Length of the longest prefix of the target's greedy tokens ``greedy`` (slots 1..) in ``tree``."""
    children = tree.children()
    node, depth = -1, 0
    for token in greedy:
        node = children.get((node, token), None)
        if node is None:
            break
        depth += 1
    return depth


def draft_tree(variant, drafter, hidden: torch.Tensor, anchor: int, log_probs, budget: int, depth: int) -> DraftTree:
    """A block's DDTree as decoding builds it, ``depth`` draft slots deep: from the distribution
    conditioned on each node's parent where the variant's drafts depend on each other
    (``variant.tree_expansion``: DSpark), else the best prefixes of ``log_probs()`` ``[D, V]`` (a
    callable: DFlash's independent slots' log-probabilities, computed only when needed). ``hidden`` ``[B, H]``."""
    expansion = variant.tree_expansion(drafter, hidden, anchor)
    if expansion is None:
        return build_tree(log_probs(), budget)
    return build_conditioned_tree(*expansion, depth, budget)


def accepted_per_budget(tree: DraftTree, greedy: list[int], budgets: list[int]) -> list[int]:
    """``accepted_in_tree`` of the tree of each of ``budgets``, from the tree of the largest one: both
    builders pop nodes best-first and a smaller budget stops earlier, so the tree of budget b is the
    first b nodes of a larger one, and the greedy path's nodes (parents precede children) are in it
    as far as their indices are below b."""
    children = tree.children()
    path, node = [], -1
    for token in greedy:
        node = children.get((node, token), None)
        if node is None:
            break
        path.append(node)
    return [sum(1 for i in path if i < budget) for budget in budgets]
