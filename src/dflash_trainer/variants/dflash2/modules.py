"""DFlash2's modules: the grouped dynamic causal convolution (and its lean backward) and the
candidate selector (parameter names as z-lab's and speculators' checkpoints)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
