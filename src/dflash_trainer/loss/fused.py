"""The draft loss's one entry point: ``fused_draft_loss(student, teacher, head, labels, weights, terms)``,
CE + soft KL + CAP + pluggable per-row terms from hidden states, never materializing ``[N, V]``.

``terms`` (``loss.terms.LossTerms``) says what to compute, validated when it is built; this module
checks the tensors, compacts to the rows with weight > 0, picks the implementation of a chunk's
element-wise work and runs the chunk loop (``loss.chunks``). The loss is a ``torch.library`` custom
op (``dflash_trainer::fused_draft_loss``, its backward a second op, both with fake implementations for
meta and fake tensors, so that ``torch.compile(fullgraph=True)`` and memory traces see through a step);
the terms cross the op as their JSON (an op's schema holds no dataclasses). Per chunk it computes the
closed-form gradient with respect to the student logits (shared/DESIGN.md section 3):

    G_i = w_i [ (1-a)(p_i - e_y) + a T (p_i^T - q_i^T) ] / sum w  -  (lambda / n_correct) / Tc * pc_i (log pc_i + H_i)

then writes ``dh_s[chunk] = G @ W`` (``dh_s`` spans all N rows, zero where the weight is 0, so the op's
outputs have static shapes; chain rule through the target's logit scale and softcap included).
Backward only returns ``grad_output * dh_s``: the head is frozen, so there is no weight gradient, and
the GEMM work is 6NHV FLOPs in all.

Implementations of a chunk's element-wise work, one module each, same math, tested equal in float64:

- ``eager``: separate eager passes, any device, and the only one with a weighted ``overlap`` term's
  gradient (``LossTerms.kernel_ready``).
- ``native`` (``loss/native.py``, ``kernels/chunk_epilogue.cpp``): the row-resident CPU kernel, built
  once per machine with the system's C++ compiler (about a second). The CPU default.
- ``triton`` (``loss/triton_epilogue.py``): the same row-resident passes on CUDA. The GPU default.
- ``reference`` (``loss/reference.py``): full ``[N, V]`` logits and autograd, for tests and benchmarks.

``torch.compile``'s inductor used to be a fifth; it was slower than the native kernel at every
measured shape, dtype and thread count on the CPU (``benchmarks/results/loss_efficiency.md``: 46-58%
of the GEMM floor in fp32 against 74-79%, 15-29% in bf16 against 46-64%) and needs what the two
kernels need (a C++ compiler, triton), so it was removed.
"""

from __future__ import annotations

import os
import warnings

import torch

from . import native
from .chunks import STATS, STATS_COLUMNS, chunk_rows, run_chunks
from .terms import LossTerms


def _terms_json(terms: LossTerms) -> str:
    """The op's string argument; a constant to torch.compile (dynamo cannot trace ``json.dumps``)."""
    return terms.to_json()


# What torch.compiler.assume_constant_result sets, without importing torch._dynamo at import time: that
# import costs about 1.6 s of CPU (`dflash-train --help`: 7.0 -> 4.0 s; a command that loads a transformers
# model imports dynamo anyway, through its masking utilities). test_loss_ops.py compiles a step through
# this op with fullgraph=True: it fails without the mark, so a torch that stops reading it is caught.
_terms_json._dynamo_marked_constant = True


COMPILE_ENV = "DFLASH_LOSS_COMPILE"  # "0" / "1" / "native" / "triton" override compile="auto"


TRITON_DTYPES = (torch.bfloat16, torch.float32)  # heads the Triton kernel takes (loss/triton_epilogue.py)
COMPILE_CHOICES = (True, False, "auto", "native", "triton")


def planned_epilogue(compile: bool | str, device_type: str, dtype: torch.dtype) -> str:
    """The implementation of a chunk's element-wise work that ``compile`` asks for: "native", "triton"
    or "eager", assuming the kernel it names can be built (the planner's view; ``epilogue_kind`` checks).

    ``compile``: "native" (the CPU kernel), "triton" (the CUDA kernel; on the CPU only under
    ``TRITON_INTERPRET=1``), True or "auto" (the kernel for the device: native on the CPU for
    bf16/fp32/fp64 heads, Triton on CUDA for bf16/fp32 heads, else the eager passes) or False (the
    eager passes); "auto" first reads the environment's DFLASH_LOSS_COMPILE (0, 1, or native / triton
    where it applies).
    """
    native_fits = device_type == "cpu" and dtype in native.ENTRY
    triton_fits = device_type == "cuda" and dtype in TRITON_DTYPES
    if compile == "auto":  # the environment asks for a kernel where it applies
        env = os.environ.get(COMPILE_ENV, "")
        by_env = {"0": False, "1": True, "native": "native" if native_fits else "auto"}
        compile = by_env.get(env, "triton" if env == "triton" and triton_fits else "auto")
    if compile not in COMPILE_CHOICES:
        raise ValueError(
            f"fused_draft_loss: compile must be 'auto', True, False, 'native' or 'triton', got {compile!r}"
        )
    if compile is False:
        return "eager"
    if compile == "native" and not native_fits:
        raise ValueError(
            f"fused_draft_loss: compile='native' runs on the CPU with a bf16, fp32 or fp64 head, got {dtype} on {device_type}"
        )
    if compile == "triton":
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"fused_draft_loss: compile='triton' takes a bf16 or fp32 head, got {dtype}")
        return "triton"
    if native_fits:
        return "native"
    if triton_fits:
        return "triton"
    return "eager"


def epilogue_kind(compile: bool | str, device: torch.device, dtype: torch.dtype) -> str:
    """What a call runs: ``planned_epilogue``, except that a kernel that cannot run here gives way to
    the eager passes. A native kernel that cannot be built warns once; Triton chosen by default but not
    installed falls back silently; Triton asked for by name where it cannot run is an error."""
    kind = planned_epilogue(compile, device.type, dtype)
    if kind == "native" and native.load() is None:
        _warn_native_unavailable()
        kind = "eager"
    if kind == "triton" and not triton_runs_on(device):
        if compile == "triton" or (compile == "auto" and os.environ.get(COMPILE_ENV) == "triton"):
            raise ValueError(
                f"fused_draft_loss: compile='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 on the "
                f"CPU); here: {TRITON_ERROR or 'device ' + device.type}"
            )
        kind = "eager"
    return kind


_triton_module = None
TRITON_ERROR: str | None = None


def triton_epilogue():
    """The Triton kernel module, or None (``TRITON_ERROR`` says why) where triton is not importable.

    Imported on first use, not with this module: importing triton takes about a second, and
    ``TRITON_INTERPRET`` is read when the kernel is decorated, so a caller sets it before the first call."""
    global _triton_module, TRITON_ERROR
    if _triton_module is None and TRITON_ERROR is None:
        try:
            from . import triton_epilogue as module
        except ImportError as e:
            TRITON_ERROR = f"{type(e).__name__}: {e}"
        else:
            _triton_module = module
    return _triton_module


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device``: CUDA, or the CPU under the interpreter."""
    module = triton_epilogue()
    return module is not None and (device.type == "cuda" or (device.type == "cpu" and module.INTERPRETED))


_NATIVE_WARNED = False


def _warn_native_unavailable() -> None:
    global _NATIVE_WARNED
    if not _NATIVE_WARNED:
        _NATIVE_WARNED = True
        warnings.warn(
            f"fused_draft_loss: the CPU kernel could not be built ({native.BUILD_ERROR}); using another implementation",
            stacklevel=4,
        )


def _triton_chunk(zs_raw, zt_raw, y, coef, g_out, t: LossTerms):
    """The Triton kernel (``loss/triton_epilogue.py``), imported on first use."""
    return triton_epilogue().chunk_epilogue(zs_raw, zt_raw, y, coef, g_out, t)


EPILOGUES = {"native": native.chunk_epilogue, "triton": _triton_chunk, "eager": None}
# The loss as torch.library custom ops: opaque to torch.compile (no graph break: dynamo records one
# call), with fake implementations that give the outputs' shapes on meta and fake tensors (tracing,
# memory traces), and the autograd formula registered beside them. Outputs have static shapes: the
# compaction to weight > 0 rows happens inside, and dh spans every row.
OP_NAMESPACE = "dflash_trainer"
_BIAS_ROWS, _BIAS_WEIGHT = 7, 8  # positions of the low-rank bias among the op's inputs


def _loss_forward(
    hs: torch.Tensor,
    ht: torch.Tensor | None,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    weights: torch.Tensor,
    slot_ids: torch.Tensor | None,
    num_slots: int,
    bias_rows: torch.Tensor | None,
    bias_weight: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    terms_json: str,
    chunk: int,
    policy: str,
    want_grad: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """``(loss [], stats [max(num_slots, 1), 10] float64, dh [N, H] or [0, H], overlap [N] or [0],
    dbias_rows [N, r] or [0, r], dbias_weight [V, r] or [0, r], topk_ids [N, K] int64,
    topk_logits [N, K])`` of ``hs`` ``[N, H]``, K = ``terms.top_k`` (0: both ``[N, 0]``).

    ``num_slots`` 0: no slots; ``terms_json`` is ``LossTerms.to_json``; ``policy`` is ``fused_draft_loss``'s
    ``compile`` as a string ("auto", "native", "triton", "true", "false"); ``dh`` (fp32, fp64 for fp64
    inputs) is d loss / d hs, zero at weight-0 rows, when ``want_grad``; likewise the bias's gradients.
    ``overlap`` is the per-row overlap (0 at weight-0 rows) when the pair statistics are on. The value
    checks that need the data run here."""
    n, hidden = hs.shape
    f = torch.promote_types(hs.dtype, torch.float32)
    rank = bias_rows.shape[1] if bias_rows is not None else 0
    terms = LossTerms.from_json(terms_json)
    _check_values(weights, labels, slot_ids, num_slots, weight.shape[0], terms.label_source)
    keep = (weights > 0).nonzero().squeeze(1)  # compaction: weight-0 rows cost nothing
    grad_rows = n if (want_grad and rank) else 0
    if keep.numel() == 0:
        dh = torch.zeros(n if want_grad else 0, hidden, dtype=f, device=hs.device)
        stats = hs.new_zeros(max(num_slots, 1), STATS_COLUMNS, dtype=torch.float64)
        overlap = hs.new_zeros(n if terms.pair_statistics else 0, dtype=f)
        de = hs.new_zeros(grad_rows, rank, dtype=f)
        dw2 = hs.new_zeros(weight.shape[0] if grad_rows else 0, rank, dtype=f)
        top_ids = torch.full((n, terms.top_k), -1, dtype=torch.int64, device=hs.device)
        top_logits = torch.full((n, terms.top_k), -torch.inf, dtype=f, device=hs.device)
        return hs.new_zeros((), dtype=f), stats, dh, overlap, de, dw2, top_ids, top_logits
    compile = {"true": True, "false": False}.get(policy, policy)
    kind = epilogue_kind(compile, hs.device, hs.dtype)
    if not terms.kernel_ready:  # a weighted overlap term: its gradient runs in the eager passes
        kind = "eager"
    loss, stats, dh, extras = run_chunks(
        hs.index_select(0, keep),
        ht.index_select(0, keep) if ht is not None else None,
        weight,
        labels.index_select(0, keep).long() if terms.label_source == "data" else None,
        weights.index_select(0, keep),
        slot_ids.index_select(0, keep).long() if num_slots else None,
        num_slots or None,
        terms,
        chunk,
        want_grad,
        EPILOGUES[kind],
        keep,
        n,
        bias_rows.index_select(0, keep) if rank else None,
        bias_weight if rank else None,
        block_ids.index_select(0, keep) if terms.credit is not None else None,
    )
    if dh is None:
        dh = torch.empty(0, hidden, dtype=f, device=hs.device)
    overlap = extras["overlap"] if extras["overlap"] is not None else hs.new_zeros(0, dtype=f)
    de = extras["dbias_rows"] if extras["dbias_rows"] is not None else hs.new_zeros(0, rank, dtype=f)
    dw2 = extras["dbias_weight"] if extras["dbias_weight"] is not None else hs.new_zeros(0, rank, dtype=f)
    return loss.to(f), stats, dh, overlap, de, dw2, extras["topk_ids"], extras["topk_logits"]


fused_draft_loss_op = torch.library.custom_op(f"{OP_NAMESPACE}::fused_draft_loss", _loss_forward, mutates_args=())


@fused_draft_loss_op.register_fake
def _(
    hs,
    ht,
    weight,
    labels,
    weights,
    slot_ids,
    num_slots,
    bias_rows,
    bias_weight,
    block_ids,
    terms_json,
    chunk,
    policy,
    want_grad,
):
    """Shapes and dtypes only (meta and fake tensors: tracing, torch.compile, memory traces)."""
    terms = LossTerms.from_json(terms_json)
    f = torch.promote_types(hs.dtype, torch.float32)
    n, rank = hs.shape[0], (bias_rows.shape[1] if bias_rows is not None else 0)
    grad_rows = n if (want_grad and rank) else 0
    return (
        hs.new_empty((), dtype=f),
        hs.new_empty(max(num_slots, 1), STATS_COLUMNS, dtype=torch.float64),
        hs.new_empty(n if want_grad else 0, hs.shape[1], dtype=f),
        hs.new_empty(n if terms.pair_statistics else 0, dtype=f),
        hs.new_empty(grad_rows, rank, dtype=f),
        hs.new_empty(weight.shape[0] if grad_rows else 0, rank, dtype=f),
        hs.new_empty(n, terms.top_k, dtype=torch.int64),
        hs.new_empty(n, terms.top_k, dtype=f),
    )


def _loss_backward(dh: torch.Tensor, grad_loss: torch.Tensor, hs_dtype: torch.dtype) -> torch.Tensor:
    """``grad_loss * dh`` ``[N, H]`` in the student's dtype: the head is frozen, so this is all of it."""
    return (dh * grad_loss.to(dh.dtype)).to(hs_dtype)


fused_draft_loss_backward_op = torch.library.custom_op(
    f"{OP_NAMESPACE}::fused_draft_loss_backward", _loss_backward, mutates_args=()
)


@fused_draft_loss_backward_op.register_fake
def _(dh, grad_loss, hs_dtype):
    return dh.new_empty(dh.shape, dtype=hs_dtype)


def _setup_context(ctx, inputs, output):
    ctx.hs_dtype = inputs[0].dtype
    bias_rows, bias_weight = inputs[_BIAS_ROWS], inputs[_BIAS_WEIGHT]
    ctx.bias_dtypes = (bias_rows.dtype, bias_weight.dtype) if bias_rows is not None else None
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(output[2], output[4], output[5])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_loss, *_grad_outputs):
    dh, de, dw2 = ctx.saved_tensors
    grads = [fused_draft_loss_backward_op(dh, grad_loss, ctx.hs_dtype)] + [None] * (ctx.num_inputs - 1)
    if ctx.bias_dtypes is not None and de.shape[0]:  # the low-rank bias: its rows and its weight
        grads[_BIAS_ROWS] = fused_draft_loss_backward_op(de, grad_loss, ctx.bias_dtypes[0])
        grads[_BIAS_WEIGHT] = fused_draft_loss_backward_op(dw2, grad_loss, ctx.bias_dtypes[1])
    return tuple(grads)


fused_draft_loss_op.register_autograd(_backward, setup_context=_setup_context)
# The ops' Python implementations by op name: what a dispatch mode that wants to look inside calls.
IMPLEMENTATIONS = {
    f"{OP_NAMESPACE}::fused_draft_loss": _loss_forward,
    f"{OP_NAMESPACE}::fused_draft_loss_backward": _loss_backward,
}


def _check(name: str, ok: bool, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"fused_draft_loss: {name} must be {expected}, got {got}")


def _check_values(weights, labels, slot_ids, num_slots: int, vocab: int, label_source: str) -> None:
    """The checks that read the data (inside the op: a traced caller never sees data-dependent branches)."""
    n = weights.shape[0]
    _check(
        "weights",
        bool(torch.isfinite(weights).all()) and bool((weights >= 0).all()),
        "finite and >= 0",
        f"min {weights.min().item() if n else 0}",
    )
    if label_source == "data":
        valid = labels[weights > 0]
        _check(
            "labels",
            valid.numel() == 0 or (int(valid.min()) >= 0 and int(valid.max()) < vocab),
            f"token ids in [0, {vocab}) where weight > 0",
            f"range [{int(valid.min())}, {int(valid.max())}]" if valid.numel() else None,
        )
    if slot_ids is not None:
        _check(
            "slot_ids",
            n == 0 or (int(slot_ids.min()) >= 0 and int(slot_ids.max()) < num_slots),
            f"[{n}] ids in [0, {num_slots})",
            tuple(slot_ids.shape),
        )


def fused_draft_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor | None,
    weights: torch.Tensor,
    terms: LossTerms | None = None,
    *,
    slot_ids: torch.Tensor | None = None,
    num_slots: int | None = None,
    block_ids: torch.Tensor | None = None,
    bias_rows: torch.Tensor | None = None,
    bias_weight: torch.Tensor | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    compile: bool | str = "auto",
) -> tuple[torch.Tensor, dict]:
    """The draft loss of ``student_hidden`` against ``teacher_hidden`` through the frozen head, for
    ``terms`` (``LossTerms()``: CE with data labels).

    Shapes: ``student_hidden`` and ``teacher_hidden`` ``[N, H]`` (the teacher row i is the target's
    final-normed hidden state that predicts the same token as student row i), ``lm_head_weight``
    ``[V, H]``, ``labels`` ``[N]`` token ids (ignored with teacher labels), ``weights`` ``[N]`` >= 0 (rows
    with weight 0 cost nothing), ``slot_ids`` ``[N]`` in ``0..num_slots-1``. ``teacher_hidden`` may be
    None when ``terms.needs_teacher`` is false (the teacher GEMM is then skipped). ``block_ids`` ``[N]``
    (a block's rows contiguous in slot order) with ``terms.credit``. ``bias_rows`` ``[N, r]`` and
    ``bias_weight`` ``[V, r]`` (same dtype as the head): a low-rank logit bias ``z_i = h_i W^T + e_i W2^T``
    (DSpark's Markov head) added to each chunk's raw logits in the same GEMM pass (never ``[N, V]``);
    both receive gradients (``W2``'s accumulated chunk by chunk).

    Returns ``(loss, metrics)``: a scalar (fp32, fp64 for fp64 inputs) that backpropagates into
    ``student_hidden`` (and the bias) only, and detached metrics: ``ce``, ``kl``, ``cap``, ``accuracy``
    (student argmax equals label), ``agreement`` (student argmax equals teacher argmax), ``label_prob``,
    ``rows``, ``correct``, one entry per pair term (its mean value); with ``slot_ids`` also ``per_slot``
    tensors ``[num_slots]`` of the same. With the pair statistics on, ``overlap_rows`` ``[N]`` (0 at
    weight-0 rows); with ``terms.top_k`` K > 0, ``topk_ids`` ``[N, K]`` int64 and ``topk_logits``
    ``[N, K]`` (each row's K largest student logits as the loss uses them, sorted descending, with their
    ids; -1 and -inf at weight-0 rows; ties in ``torch.topk``'s order, the native kernel's lower id
    first), selected per chunk, never from ``[N, V]``; the loss and its gradients do not depend on K.
    ``loss.candidates.candidate_logits`` re-gathers these logits with a gradient to the hidden states.

    ``compile``: the implementation of each chunk's element-wise work: "native" (the CPU kernel),
    "triton" (the CUDA kernel), True (the device's kernel), False (the eager passes), or "auto" (the
    default; see ``epilogue_kind``). All give the same results (tested in float64); a kernel that
    cannot be built falls back to the eager passes with one warning.
    """
    terms = LossTerms() if terms is None else terms
    _check("terms", isinstance(terms, LossTerms), "a loss.terms.LossTerms", type(terms).__name__)
    hs, ht, w_head = student_hidden, teacher_hidden, lm_head_weight
    _check("student_hidden", hs.dim() == 2 and hs.is_floating_point(), "a floating [N, H] tensor", tuple(hs.shape))
    n, hidden = hs.shape
    _check("lm_head_weight", w_head.dim() == 2 and w_head.shape[1] == hidden, f"[V, {hidden}]", tuple(w_head.shape))
    _check(
        "lm_head_weight.requires_grad",
        not w_head.requires_grad,
        "False (the head is frozen; pass weight.detach())",
        True,
    )
    _check("lm_head_weight.dtype", w_head.dtype == hs.dtype, f"{hs.dtype} like student_hidden", w_head.dtype)
    vocab = w_head.shape[0]
    if ht is None:
        _check("teacher_hidden", not terms.needs_teacher, "given for KL, teacher labels or pair terms", None)
    else:
        _check("teacher_hidden", ht.shape == hs.shape, f"shaped like student_hidden {tuple(hs.shape)}", tuple(ht.shape))
        _check("teacher_hidden.dtype", ht.dtype == hs.dtype, f"{hs.dtype} like student_hidden", ht.dtype)
        ht = ht.detach()
    _check(
        "weights",
        weights.shape == (n,) and weights.is_floating_point(),
        f"a floating [{n}] tensor",
        f"{tuple(weights.shape)} {weights.dtype}",
    )
    if terms.label_source == "data":
        _check(
            "labels",
            labels is not None and labels.shape == (n,) and not labels.is_floating_point(),
            f"an integer [{n}] tensor",
            None if labels is None else f"{tuple(labels.shape)} {labels.dtype}",
        )
    if slot_ids is not None:
        _check("num_slots", num_slots is not None and num_slots >= 1, "given with slot_ids", num_slots)
        _check("slot_ids", slot_ids.shape == (n,), f"[{n}] ids in [0, {num_slots})", tuple(slot_ids.shape))
    _check("compile", compile in COMPILE_CHOICES, "'auto', True, False, 'native' or 'triton'", repr(compile))
    _check("terms.top_k", terms.top_k <= vocab, f"<= {vocab} (the vocabulary)", terms.top_k)
    _check(
        "block_ids",
        terms.credit is None or (block_ids is not None and block_ids.shape == (n,)),
        f"[{n}] with a block credit",
        None,
    )
    if bias_rows is not None or bias_weight is not None:
        _check(
            "bias_rows", bias_rows is not None and bias_rows.dim() == 2 and bias_rows.shape[0] == n, f"[{n}, r]", None
        )
        r = bias_rows.shape[1]
        _check("bias_weight", bias_weight is not None and bias_weight.shape == (vocab, r), f"[{vocab}, {r}]", None)
        _check("bias_rows.dtype", bias_rows.dtype == hs.dtype == bias_weight.dtype, f"{hs.dtype}", bias_rows.dtype)
    policy = ("true" if compile else "false") if isinstance(compile, bool) else compile
    loss, stats, _, overlap, _, _, topk_ids, topk_logits = fused_draft_loss_op(
        hs,
        ht,
        w_head.detach(),
        labels if terms.label_source == "data" else None,
        weights,
        slot_ids,
        num_slots if slot_ids is not None else 0,
        bias_rows,
        bias_weight,
        block_ids.long() if (terms.credit is not None and block_ids is not None) else None,
        _terms_json(terms),
        chunk_rows(vocab, chunk_size, memory_budget),
        policy,
        torch.is_grad_enabled() and (hs.requires_grad or (bias_rows is not None and bias_rows.requires_grad)),
    )
    metrics = _metrics(stats, ht is not None, slot_ids is not None, terms)
    if terms.pair_statistics:
        metrics["overlap_rows"] = overlap
    if terms.top_k:
        metrics["topk_ids"], metrics["topk_logits"] = topk_ids, topk_logits
    return loss, metrics


def _metrics(stats: torch.Tensor, has_teacher: bool, per_slot: bool, terms: LossTerms) -> dict:
    col = {name: i for i, name in enumerate(STATS)}

    def summarize(s: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = s[..., 0].clamp(min=1)
        out = {
            "rows": s[..., 0],
            "correct": s[..., 4],
            "ce": s[..., 1] / rows,
            "kl": s[..., 2] / rows,
            "cap": s[..., 3] / s[..., 4].clamp(min=1),
            "accuracy": s[..., 4] / rows,
            "label_prob": s[..., 6] / rows,
        }
        if has_teacher:
            out["agreement"] = s[..., 5] / rows
        for term in terms.pair_terms:  # each term's mean value: linear in its statistic's mean
            out[term.name] = term.offset + term.scale * (s[..., col[term.statistic]] / rows)
        return out

    metrics = summarize(stats.sum(0))
    if per_slot:
        metrics["per_slot"] = summarize(stats)
    return metrics
