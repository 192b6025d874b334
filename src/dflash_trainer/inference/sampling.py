"""How the target picks its token at a verified position: greedy (T = 0) or sampled (T > 0, top-p).

Speculative sampling here keeps the drafter's tokens as they are (its argmax chain or its DDTree) and
lets the target sample its own token at every verified position, under that position's context: for a
chain, position ``i`` sees the anchor and drafts ``1..i``; for a tree, a node sees its ancestors. The
walk follows the target's samples: a draft (or child) is accepted when it equals the target's sample,
and the first sample that no draft matches is the bonus token. Every emitted token is therefore a
sample of the target's own distribution given the tokens before it, so the output is distributed
exactly as sampling from the target alone (tested statistically), whatever the drafter proposes;
the drafter only decides how many tokens one target pass yields. The probability that slot ``k`` is
accepted, given slots ``1..k-1`` were, is ``q_T(draft_k | context)``: the target's sampling
probability of the drafted token.

A verification policy turns the target's logits ``[q, V]`` of one verification pass into a picker
``pick(row, candidates) -> token``: the target's token after row ``row``. ``candidates`` are the
draft tokens that would be accepted there (the chain's next draft, a node's children); the correct
policies ignore them, they exist so that a test can build a biased verifier and show it is caught.
Rows are picked lazily, in walk order, so a seeded policy draws one uniform number per emitted token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Picker = Callable[[int, list[int]], int]


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``[..., V]`` logits -> the target's sampling distribution ``[..., V]`` (float32, float64 in ->
    float64 out): softmax of ``logits / temperature``, then nucleus filtering: a token is kept when the
    probability of the tokens more probable than it is below ``top_p`` (the most probable token is
    always kept; Hugging Face's ``TopPLogitsWarper`` rule), and the kept mass is renormalized.
    (Tokens of exactly equal probability at the nucleus's edge are ordered as ``topk`` orders them.)"""
    probs = _tempered_softmax(logits, temperature, top_p)
    if top_p >= 1:
        return probs
    probs = probs * _nucleus(probs, top_p)
    return probs / probs.sum(-1, keepdim=True)


def sampling_probs_by_sort(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``sampling_probs`` the plain way, one full sort of the vocabulary per row: the reference
    ``sampling_probs``' partial sort is tested against."""
    probs = _tempered_softmax(logits, temperature, top_p)
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    probs = probs * _kept(sorted_probs, order, top_p, probs.shape[-1])
    return probs / probs.sum(-1, keepdim=True)


def _tempered_softmax(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits.to(dtype) / temperature, dim=-1)


def _kept(sorted_probs: torch.Tensor, order: torch.Tensor, top_p: float, vocab: int) -> torch.Tensor:
    """The nucleus as a bool mask ``[..., vocab]`` from the most probable tokens in descending order
    (``sorted_probs``, their ids ``order`` ``[..., k]``; every kept token among them)."""
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True
    keep = torch.zeros(*order.shape[:-1], vocab, dtype=torch.bool, device=order.device)
    return keep.scatter(-1, order, keep_sorted)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus mask ``[..., V]`` from each row's top ``k`` tokens only, ``k`` grown 4x for the rows
    whose top ``k`` do not yet hold ``top_p`` (a token past them then has ``top_p`` before it and is
    dropped): a partial sort of a few dozen tokens where decoding's peaked rows need them, instead of a
    sort of the whole vocabulary per verified row (what dominated eval's sampled acceptance), and one
    flat row of a tree's batch grows alone instead of making every row sort thousands."""
    vocab = probs.shape[-1]
    flat = probs.reshape(-1, vocab)
    keep = torch.zeros(flat.shape, dtype=torch.bool, device=probs.device)
    rows = torch.arange(flat.shape[0], device=probs.device)
    k = min(vocab, 64)
    while rows.numel():
        top, order = flat[rows].topk(k, dim=-1)  # descending
        done = top.cumsum(-1)[:, -1] >= top_p if k < vocab else torch.ones_like(rows, dtype=torch.bool)
        keep[rows[done]] = _kept(top[done], order[done], top_p, vocab)
        rows, k = rows[~done], min(vocab, 4 * k)
    return keep.view(probs.shape)


def sample_from(probs: torch.Tensor, uniform: float) -> int:
    """Inverse-CDF sample of ``probs`` ``[V]`` with ``uniform`` in (0, 1]: the first token whose
    cumulative probability reaches ``uniform * total``. A token of probability 0 is never returned."""
    cdf = probs.double().cumsum(-1)
    x = torch.tensor([uniform], dtype=torch.float64, device=cdf.device) * cdf[-1]
    return min(int(torch.searchsorted(cdf, x)), probs.shape[-1] - 1)


class GreedyVerification:
    """T = 0: the target's argmax at every position; speculative decoding then reproduces the
    target's plain greedy decoding token for token."""

    temperature = 0.0
    top_p = 1.0

    def rows(self, logits: torch.Tensor) -> Picker:
        greedy = logits.argmax(-1).tolist()
        return lambda row, candidates: greedy[row]


class SampledVerification:
    """T > 0: the target samples every verified position from ``sampling_probs(logits, T, top_p)``.

    The uniforms come from a CPU ``torch.Generator`` seeded with ``seed``, so a run is reproducible
    and the same seed gives the same draws on any device."""

    def __init__(self, temperature: float, top_p: float = 1.0, seed: int = 0):
        if not temperature > 0:
            raise ValueError(f"sampling needs temperature > 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.generator = torch.Generator().manual_seed(seed)

    def uniform(self) -> float:
        """One draw in (0, 1] (``1 - U[0, 1)``: never 0, so a zero-probability token is never picked)."""
        return 1.0 - float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def rows(self, logits: torch.Tensor) -> Picker:
        # a row's distribution only when the walk reaches it: a verification pass's walk usually stops
        # after a few of its rows (sampling_probs of one row equals that row of the batch, bit for bit)
        return lambda row, candidates: sample_from(
            sampling_probs(logits[row], self.temperature, self.top_p), self.uniform()
        )


def verification_policy(temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
    """``GreedyVerification`` for ``temperature == 0``, else ``SampledVerification``."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return GreedyVerification()
    return SampledVerification(temperature, top_p, seed)
