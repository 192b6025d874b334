"""The chunk loop of the draft loss, written once for every implementation of a chunk's element-wise
work (``eager.eager_chunk``, or a kernel: ``native.chunk_epilogue``, ``triton_epilogue.chunk_epilogue``).

Rows are walked in chunks of ``c``; per chunk the student and teacher logits are computed in fp32 (fp64
for fp64 inputs) for that chunk only, then the row terms and the closed-form gradient with respect to
the student logits, and ``dh_s[chunk] = G @ W`` (shared/DESIGN.md section 3). Memory beyond the inputs:
``dh_s`` (``N*H*4`` bytes, twice with CAP, whose normalization by the global number of correct rows is
only known after the last chunk) plus per chunk the implementation's ``[c, V]`` buffers: three fp32
and one transient for the eager passes (four with KL at T != 1), ``c*V*12`` bytes with an fp32 head
and ``c*V*6`` with bf16 for the kernels; CAP's correct-row subset and a bf16 head's GEMM output reach
``c*V*26`` at worst (``BYTES_PER_CHUNK_ELEMENT``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native
from .eager import eager_chunk
from .logits import chain_to_raw, transform_logits
from .terms import LossTerms

# Bytes per chunk element that the chunk loop keeps alive at its worst, used to size chunks from a
# byte budget: 16-20 for the common cases above, 24 for KL at T != 1 and 26 for CAP with every row
# correct and a bf16 head (the subset buffers and the bf16 GEMM output), as the planner's allocator
# log measured; the budget must hold in the worst case.
BYTES_PER_CHUNK_ELEMENT = 26
DEFAULT_MEMORY_BUDGET = 256 * 2**20  # 256 MiB of chunk workspace when neither chunk_size nor budget is given


@dataclass
class ChunkBias:
    """A low-rank logit bias of one chunk (DSpark's Markov head), a rank-r term of the same logits: ``z = h W^T + e W2^T``.

    ``e`` ``[c, r]`` bias features (head dtype), ``w2`` ``[V, r]`` (head dtype); ``de`` ``[c, r]`` receives
    ``G @ W2`` and ``dw2`` ``[V, r]`` accumulates ``G^T @ e`` over the chunks (compute dtype)."""

    e: torch.Tensor
    w2: torch.Tensor
    de: torch.Tensor | None = None
    dw2: torch.Tensor | None = None

    def add_to(self, z_raw: torch.Tensor) -> None:
        """``z_raw += e @ W2^T`` in place (the raw logits, before the target's transform)."""
        if z_raw.dtype == self.w2.dtype:
            z_raw.addmm_(self.e, self.w2.T)
        else:
            z_raw.add_(self.e @ self.w2.T)

    def backward(self, g: torch.Tensor, row_scale: torch.Tensor | None = None) -> None:
        """``de = G @ W2``, ``dw2 += G^T @ e`` for the chunk's gradient ``G`` ``[c, V]`` w.r.t. raw logits;
        ``row_scale`` ``[c]`` (compute dtype) multiplies G's rows first, applied to the ``[c, r]`` sides."""
        if self.de is None:
            return
        gw, e = g.to(self.w2.dtype), self.e
        self.de.copy_(gw @ self.w2)
        if row_scale is not None:  # diag(s) G @ W2 and G^T @ diag(s) e
            self.de.mul_(row_scale[:, None])
            e = (e.to(row_scale.dtype) * row_scale[:, None]).to(e.dtype)
        self.dw2.add_((gw.T @ e).to(self.dw2.dtype))


def chunk_rows(vocab_size: int, chunk_size: int | None, memory_budget: int | None) -> int:
    """Rows per chunk: explicit, or the most whose worst-case workspace ``c*V*26`` bytes fits ``memory_budget``."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    rows = budget // (vocab_size * BYTES_PER_CHUNK_ELEMENT)
    if rows < 1:
        raise ValueError(
            f"memory_budget {budget} bytes is below one row's workspace ({vocab_size * BYTES_PER_CHUNK_ELEMENT} "
            f"bytes for vocabulary {vocab_size})"
        )
    return int(rows)


def kernel_chunk(
    epilogue, hs_rows, ht_rows, weight, y_data, coef, t: LossTerms, buffers, dh_rows, bias=None, credit=None, extra=None
):
    """One chunk with a kernel for the element-wise work: the logit GEMMs in the head's dtype (the
    low-rank ``bias`` added to the raw student logits), then ``epilogue`` (``native.chunk_epilogue`` or
    the Triton kernel's: row terms, G in the head's dtype), then ``G @ W`` (and the bias's gradients).
    Same returns as ``eager.eager_chunk``.

    The pair statistics (``t.pair_statistics``) come out of the same row pass (the ``renyi_half``
    terms' gradient inside G). With a block credit a row's coefficient is known only once the kernel
    has the confidence of all the block's rows: the kernel then writes G with coefficient 1, and the
    credit scales G's rows on the small sides of the GEMMs that follow (``[c, H]``, ``[c, r]``), never
    as another pass over G.

    The top K candidates (``t.top_k`` K > 0) go to ``extra["topk"]`` (logits ``[c, K]``, ids ``[c, K]``):
    the native kernel selects them in its row pass; after the Triton kernel a ``torch.topk`` reads the
    chunk's raw-logit buffer once more and the K values are transformed (the transform is monotone:
    increasing, or decreasing for a negative logit scale)."""
    zs_raw = torch.mm(hs_rows, weight.T, out=buffers["zs"])  # [c, V] untransformed
    if bias is not None:
        bias.add_to(zs_raw)
    zt_raw = torch.mm(ht_rows, weight.T, out=buffers["zt"]) if ht_rows is not None else None
    g = buffers["g"] if dh_rows is not None else None
    out = epilogue(zs_raw, zt_raw, y_data, torch.ones_like(coef) if credit is not None else coef, g, t)
    if t.top_k:
        if epilogue is native.chunk_epilogue:
            *out, top_ids, top_logits = out
        else:
            top_raw, top_ids = torch.topk(zs_raw, t.top_k, dim=-1, largest=t.logit_scale >= 0)
            top_logits = transform_logits(top_raw.to(coef.dtype), t.logit_scale, t.softcap)
        extra["topk"] = (top_logits, top_ids)
    confidence = t.credit.confidence if t.credit is not None else None
    if t.pair_statistics:
        *out, overlap, renyi_half = out
        if confidence == "overlap":
            coef = credit(overlap)
        extra.update(overlap=overlap, renyi_half=renyi_half)
    if confidence == "label_prob":  # out[0], out[1]: the rows' lse and z_y, so p(y) = exp(z_y - lse)
        coef = credit(torch.exp(out[1] - out[0]))
    if extra is not None:
        extra.update(coef=coef)
    if g is not None:
        if weight.dtype == dh_rows.dtype:
            torch.mm(g, weight, out=dh_rows)
        else:
            dh_rows.copy_(torch.mm(g, weight, out=buffers["dh"][: g.shape[0]]))
        if credit is not None:
            dh_rows.mul_(coef[:, None])
        if bias is not None:
            bias.backward(g, coef if credit is not None else None)

    def logits_of(idx):
        return transform_logits(zs_raw[idx].to(coef.dtype), t.logit_scale, t.softcap)

    return (*out, logits_of)


@torch.no_grad()
def run_chunks(
    hs,
    ht,
    weight,
    labels,
    weights,
    slot_ids,
    num_slots,
    t: LossTerms,
    chunk: int,
    want_grad: bool,
    epilogue,
    keep,
    rows_in,
    bias_rows=None,
    bias_weight=None,
    block_ids=None,
):
    """The chunk loop. Inputs ``[n, ...]`` are already compacted to the rows with weight > 0; ``keep``
    ``[n]`` says where each of them sits among the ``rows_in`` (N) rows of the call.

    Returns ``(loss, stats, dh, extras)`` where ``stats`` is ``[num_slots or 1, 10]`` float64 sums of
    ``STATS`` (rows, ce, kl, entropy of correct rows, correct, agreement, label probability, and the three
    pair statistics) and ``dh`` ``[N, H]`` is the gradient of the loss w.r.t. the uncompacted student
    rows, zero at weight-0 rows (None unless ``want_grad``). ``epilogue`` is the chunk kernel to use
    (None: the eager passes of ``eager.eager_chunk``). ``bias_rows`` ``[n, r]`` and ``bias_weight``
    ``[V, r]`` are the low-rank logit bias (``ChunkBias``); ``block_ids`` ``[n]`` (a block credit) keeps
    every block inside one chunk. ``extras``: ``overlap`` ``[N]`` (with pair statistics), ``dbias_rows``
    ``[N, r]`` and ``dbias_weight`` ``[V, r]`` (with a bias and ``want_grad``), else None; always
    ``topk_ids`` ``[N, K]`` int64 and ``topk_logits`` ``[N, K]`` (K = ``t.top_k``, maybe 0), -1 and -inf
    at weight-0 rows.
    """
    n, hidden = hs.shape
    f = torch.promote_types(hs.dtype, torch.float32)
    a, temp, tc = t.kl_weight, t.temperature, t.cap_temperature
    inv_wsum = 1.0 / weights.double().sum().item()
    dev = hs.device
    stats = torch.zeros(num_slots or 1, STATS_COLUMNS, dtype=torch.float64, device=dev)
    # dh spans all N rows, so that the op around this loop has outputs of static shape (which rows are
    # kept is data); each chunk's G @ W goes to dh_chunk, then to its rows of dh.
    dh = torch.zeros(rows_in, hidden, dtype=f, device=dev) if want_grad else None
    dh_cap = torch.zeros(rows_in, hidden, dtype=f, device=dev) if (want_grad and t.cap_weight > 0) else None
    loss_main = torch.zeros((), dtype=torch.float64, device=dev)
    cap_sum, n_correct = torch.zeros((), dtype=torch.float64, device=dev), 0
    bounds = chunk_bounds(n, chunk, block_ids)
    c_max, vocab = max(b.stop - b.start for b in bounds), weight.shape[0]

    def chunk_buffers(for_kernel: bool) -> dict[str, torch.Tensor]:
        if for_kernel:  # raw GEMM outputs, G and G @ W, all in the head's dtype: the kernel upcasts as it reads
            needed = (("zs", vocab, True), ("zt", vocab, ht is not None), ("g", vocab, want_grad))
            needed += (("dh", hidden, want_grad and weight.dtype != f),)
            dtype = weight.dtype
        else:
            needed = (("zs", vocab, True), ("p", vocab, True), ("zt", vocab, ht is not None), ("q", vocab, a > 0))
            needed += (("r", vocab, t.pair_statistics),)
            dtype = f
        return {name: torch.empty(c_max, cols, dtype=dtype, device=dev) for name, cols, need in needed if need}

    buffers = chunk_buffers(epilogue is not None)
    dh_chunk = torch.empty(c_max, hidden, dtype=f, device=dev) if want_grad else None
    rank = bias_rows.shape[1] if bias_rows is not None else 0
    de_chunk = torch.empty(c_max, rank, dtype=f, device=dev) if (want_grad and rank) else None
    de = torch.zeros(rows_in, rank, dtype=f, device=dev) if de_chunk is not None else None
    dw2 = torch.zeros(vocab, rank, dtype=f, device=dev) if de_chunk is not None else None
    de_cap = torch.zeros(rows_in, rank, dtype=f, device=dev) if (de is not None and dh_cap is not None) else None
    dw2_cap = torch.zeros(vocab, rank, dtype=f, device=dev) if de_cap is not None else None
    overlap_rows = torch.zeros(rows_in, dtype=f, device=dev) if t.pair_statistics else None
    topk_ids = torch.full((rows_in, t.top_k), -1, dtype=torch.int64, device=dev)
    topk_logits = torch.full((rows_in, t.top_k), -torch.inf, dtype=f, device=dev)
    inv_rows = 1.0 / n  # a block credit: sum_t W_t l_t / (rows with loss), as speculators normalizes it

    for rows in bounds:
        c = rows.stop - rows.start
        w = weights[rows].to(f)
        coef = w * inv_wsum  # [c] each row's share of the weighted mean
        y_data = labels[rows] if t.label_source == "data" else None
        ht_rows = ht[rows] if ht is not None else None
        dh_rows = dh_chunk[:c] if want_grad else None
        bias = None
        if rank:
            de_rows = de_chunk[:c] if de_chunk is not None else None
            bias = ChunkBias(bias_rows[rows], bias_weight, de_rows, dw2)
        credit = None
        if t.credit is not None:
            credit = block_credit(block_ids[rows], t.credit.alpha, inv_rows)
        extra = {}
        args = (hs[rows], ht_rows, weight, y_data, coef, t, {k: b[:c] for k, b in buffers.items()}, dh_rows)
        if epilogue is not None:
            out = kernel_chunk(epilogue, *args, bias, credit, extra)
        else:
            out = eager_chunk(*args, bias, credit, extra)
        lse, z_y, s_arg, t_arg, entropy, kl, logits_of = out
        coef = extra["coef"]
        if dh is not None:
            dh.index_copy_(0, keep[rows], dh_rows)
        if de is not None:
            de.index_copy_(0, keep[rows], de_rows)
        y = t_arg if t.label_source == "teacher" else y_data
        ce = lse - z_y
        correct = s_arg == y
        cap_sum += entropy[correct].double().sum()
        n_correct += int(correct.sum())
        row_loss = t.base_weight * ((1 - a) * ce + a * temp**2 * kl)
        overlap, renyi_half, reverse_kl = extra.get("overlap"), extra.get("renyi_half"), extra.get("reverse_kl")
        for term in t.pair_terms:  # the pluggable per-row terms: offset + scale * statistic, weighted
            if term.weight > 0:
                value = term.offset + term.scale * extra[term.statistic]
                row_loss = row_loss + term.weight * value
        loss_main += (coef * row_loss).double().sum()
        if overlap_rows is not None:
            overlap_rows.index_copy_(0, keep[rows], overlap)
        if t.top_k:
            top_logits, top_ids = extra["topk"]
            topk_ids.index_copy_(0, keep[rows], top_ids)
            topk_logits.index_copy_(0, keep[rows], top_logits.to(f))

        if dh_cap is not None and correct.any():
            # d entropy / dz = -(1/Tc) pc (log pc + H), on the correct rows only.
            idx = correct.nonzero().squeeze(1)
            z_idx = logits_of(idx)  # [k, V] transformed logits of these rows, a fresh copy
            if t.softcap:  # the softcap chain rule reads them after g is built: keep both
                g = z_idx / tc
            else:  # reuse the copy: one [k, V] buffer, as the planner's loss_workspace prices CAP
                g, z_idx = z_idx.div_(tc), None
            g.sub_(torch.logsumexp(g, -1, keepdim=True))  # log pc
            pc = g.exp()
            g.add_(entropy[idx, None]).mul_(pc).mul_(-1.0 / tc)
            pc = None
            chain_to_raw(g, z_idx, t)
            dh_cap[keep[rows.start + idx]] = g.to(weight.dtype).matmul(weight).to(f)
            if de_cap is not None:  # the entropy's gradient reaches the low-rank bias too
                cap_bias = ChunkBias(
                    bias_rows[rows.start + idx], bias_weight, torch.empty_like(de_chunk[: idx.numel()]), dw2_cap
                )
                cap_bias.backward(g)
                de_cap[keep[rows.start + idx]] = cap_bias.de
            g = z_idx = None

        # Statistics, per slot when slot ids are given.
        group = slot_ids[rows] if num_slots else torch.zeros_like(y)
        agree = (s_arg == t_arg) if t_arg is not None else torch.zeros_like(correct)
        cols = torch.stack(
            [
                torch.ones_like(ce),
                ce,
                kl,
                torch.where(correct, entropy, 0.0),
                correct.to(f),
                agree.to(f),
                torch.exp(z_y - lse),
                overlap if overlap is not None else torch.zeros_like(ce),
                renyi_half if renyi_half is not None else torch.zeros_like(ce),
                reverse_kl if reverse_kl is not None else torch.zeros_like(ce),
            ],
            1,
        ).double()
        stats.index_add_(0, group, cols)

    cap = cap_sum / max(n_correct, 1)
    loss = loss_main + t.cap_weight * cap
    if dh_cap is not None and n_correct:
        dh.add_(dh_cap, alpha=t.cap_weight / n_correct)
        if de_cap is not None:
            de.add_(de_cap, alpha=t.cap_weight / n_correct)
            dw2.add_(dw2_cap, alpha=t.cap_weight / n_correct)
    extras = {"overlap": overlap_rows, "dbias_rows": de, "dbias_weight": dw2}
    extras.update(topk_ids=topk_ids, topk_logits=topk_logits)
    return loss, stats, dh, extras


def chunk_bounds(n: int, chunk: int, block_ids: torch.Tensor | None) -> list[slice]:
    """Row ranges of at most ``chunk`` rows; with ``block_ids`` ``[n]`` (rows of one block are
    contiguous) a range ends at a block boundary, so that a block's credit is computed in one
    chunk. A block longer than ``chunk`` gets a chunk of its own."""
    if block_ids is None:
        return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    ids = block_ids.tolist()
    out, start = [], 0
    while start < n:
        end = min(start + chunk, n)
        if end < n and ids[end] == ids[end - 1]:
            back = end - 1
            while back > start and ids[back - 1] == ids[end]:
                back -= 1
            if back > start:
                end = back
            else:  # one block wider than a chunk: take all of it
                while end < n and ids[end] == ids[end - 1]:
                    end += 1
        out.append(slice(start, end))
        start = end
    return out


def block_credit(block_ids: torch.Tensor, alpha: float, inv_rows: float):
    """``x [c] -> coef [c]``: the block credit of each row, detached, over whole blocks, from a per-row
    confidence ``x`` in [0, 1]: the overlap a (D-PARD) or the label probability p(y) (D-PACE).

    ``s_i = alpha + (1 - alpha) x_i``; a row t of a block gets ``W_t = sum_{k >= t} prod_{i <= k} s_i``
    (i, k over the block's rows with loss, in slot order), times ``inv_rows``: the derivative of the
    block's expected accepted length with respect to log s_t, so a slot earns the credit of every
    later slot its acceptance gates."""

    new_block = torch.ones_like(block_ids, dtype=torch.bool)
    new_block[1:] = block_ids[1:] != block_ids[:-1]
    starts = new_block.nonzero().squeeze(1).tolist() + [block_ids.numel()]

    def credit(x: torch.Tensor) -> torch.Tensor:
        s = alpha + (1.0 - alpha) * x.detach()
        out = torch.empty_like(s)
        for lo, hi in zip(starts[:-1], starts[1:]):  # a chunk holds a few whole blocks
            out[lo:hi] = torch.cumprod(s[lo:hi], 0).flip(0).cumsum(0).flip(0)
        return out * inv_rows

    return credit


# The columns of the chunk loop's float64 sums (per slot): the base row terms, then the pair statistics.
STATS = ("rows", "ce", "kl", "entropy", "correct", "agreement", "label_prob", "overlap", "renyi_half", "reverse_kl")
STATS_COLUMNS = len(STATS)
