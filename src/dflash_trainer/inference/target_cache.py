"""The target's cache during speculative decoding, rolled back exactly on every family.

Three kinds of cache layer, and how each is put back to "the accepted tokens only":

- full attention (``DynamicLayer``): keys/values per token; chain crops the rejected tail, tree
  compaction keeps the prefix and the accepted path's rows.
- sliding window (``DynamicSlidingWindowLayer``, Gemma 3, gpt-oss, Mistral): the layer holds only the
  last ``window - 1`` tokens, so rows are never indexed by absolute position. The cache records the
  past during a forward (``activate_past_recording``) so that cropping is exact, and tree rows are
  addressed from the end (the last ``1 + n`` rows are the anchor and the tree nodes). Tree masks are
  built per layer kind, with the window applied to absolute positions.
- linear attention (Gated DeltaNet in Qwen3.5 / Qwen3-Next): a recurrent state that cannot be
  cropped (it summarises all tokens) and a short conv state. Rollback is a snapshot of the recurrent
  states before verification, a crop of everything else to before the round, and a replay of the
  accepted tokens (one extra target forward of ``accepted + 1`` tokens per round that rejects a draft).
  A tree cannot be verified in one pass (an ancestor mask does not isolate branches inside a recurrence),
  so each root-to-leaf path is verified as its own chain, all paths in one batch over copies of the
  state: ``leaves * (depth + 1)`` verified tokens instead of ``1 + nodes``, plus the replay.

Every path is exact by construction: the states after a round are those of a forward over exactly the
accepted tokens (tested token for token against plain greedy decoding on each family).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .ddtree import DraftTree


def _has_kv(layer) -> bool:
    return getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False)


class TargetCache:
    """A ``DynamicCache`` for the target plus the bookkeeping to roll it back exactly.

    ``length`` is the number of tokens the cache holds (positions ``0..length-1``)."""

    def __init__(self, model):
        self.cache = DynamicCache(config=model.config)
        # sliding-window and conv states keep the tokens of the last forward until the next crop,
        # so a rejected tail can be removed even past the window
        self.cache.activate_past_recording()
        self.recurrent = any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.cache.layers)
        self.length = 0
        self._saved: list[dict[int, torch.Tensor]] | None = None

    # ---- chain and prefill -------------------------------------------------------------------
    def commit(self, fed: int) -> None:
        """All ``fed`` tokens of the last forward are kept; trim recorded states to their working size."""
        self.cache.crop(0)
        self.length += fed

    def save(self) -> None:
        """Before a verification forward: remember the recurrent states (the only uncroppable part)."""
        if self.recurrent:
            self._saved = [
                {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None}
                if isinstance(layer, LinearAttentionCacheLayerMixin)
                else {}
                for layer in self.cache.layers
            ]

    def keep_prefix(self, fed: int, kept: int) -> bool:
        """After a chain forward of ``fed`` tokens of which the first ``kept`` are accepted. Returns True
        when the caller must replay those ``kept`` tokens (then call ``commit(kept)``)."""
        if not self.recurrent or kept == fed:
            self.cache.crop(-(fed - kept))
            self.length += kept
            return False
        self.rewind(fed)
        return True

    def rewind(self, fed: int) -> None:
        """Put the cache back to before the last forward of ``fed`` tokens (batch 1)."""
        self.cache.crop(-fed)
        if self._saved is not None:
            for layer, saved in zip(self.cache.layers, self._saved):
                for i, state in saved.items():
                    layer.recurrent_states[i].copy_(state)

    # ---- tree on attention-only targets ------------------------------------------------------
    def tree_mask(self, pos: int, tree: DraftTree, dtype: torch.dtype, device):
        """Additive mask(s) for a forward of ``[anchor, tree nodes]`` at positions ``pos + depth``:
        a node sees the cache, the anchor and its ancestors, within each sliding layer's window.
        One ``[1, 1, 1+n, kv]`` tensor when all attention layers are of one kind, else a dict by layer type."""
        depths = torch.tensor([0, *tree.depths])
        query_pos = pos + depths  # [1+n]
        related = torch.ones(1 + len(tree), 1 + len(tree), dtype=torch.bool).tril()  # anchor row/column
        related[1:, 1:] = tree.ancestor_mask()
        related[0, 1:] = False
        masks = {}
        for layer in self.cache.layers:
            window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
            kind = "sliding_attention" if window else "full_attention"
            if kind in masks:
                continue
            cached = layer.keys.shape[-2] if _has_kv(layer) else 0  # the last `cached` positions before pos
            kv_pos = torch.cat([torch.arange(pos - cached, pos), query_pos])
            allowed = torch.cat([torch.ones(1 + len(tree), cached, dtype=torch.bool), related], dim=1)
            if window:
                allowed &= kv_pos[None, :] > query_pos[:, None] - window
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            masks[kind] = mask[None, None].to(device)
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def keep_tree_path(self, num_nodes: int, path: list[int]) -> None:
        """After a tree forward of ``[anchor, num_nodes nodes]``: keep the anchor and the accepted
        nodes ``path``. Rows are addressed from the end, never by absolute position."""
        for layer in self.cache.layers:
            if not _has_kv(layer):
                continue
            size = layer.keys.shape[-2]
            start = size - num_nodes  # the first tree node's row
            keep = torch.tensor([*range(start), *(start + i for i in path)], device=layer.keys.device)
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length -= num_nodes - len(path)
        self.cache.crop(0)
        self.length += 1 + len(path)

    # ---- tree on recurrent targets -----------------------------------------------------------
    def expand(self, copies: int) -> None:
        """Batch ``copies`` copies of the (batch 1) state, one per tree path."""
        self.cache.reorder_cache(torch.zeros(copies, dtype=torch.long))

    def collapse(self, fed: int) -> None:
        """Back to batch 1 and to before the last forward of ``fed`` tokens per path."""
        self.cache.reorder_cache(torch.zeros(1, dtype=torch.long))
        self.rewind(fed)


def root_to_leaf_paths(tree: DraftTree) -> list[list[int]]:
    """Every leaf's path of nodes from depth 1 down to it (each node lies on at least one path)."""
    has_child = set(tree.parents)
    paths = []
    for leaf in range(len(tree)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = tree.parents[node]
        paths.append(path[::-1])
    return paths
