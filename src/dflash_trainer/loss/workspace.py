"""What the fused loss costs in memory, priced beside its code: the planner adds it to the loss phase of
a step (``planner.formulas.loss_workspace``), and ``tests/test_planner.py`` measures it with the CPU
allocator against this formula."""

from __future__ import annotations


def chunk_loop_bytes(
    *,
    rows: int,
    queries: int,
    vocab: int,
    hidden: int,
    chunk: int,
    head_bytes: int,
    teacher: bool,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
    cap_weight: float = 0.0,
    cap_temperature: float = 1.0,
    tv_weight: float = 0.0,
    per_row_terms: bool = False,
    bias_rank: int = 0,
    correct_fraction: float = 1.0,
    kernel: bool = False,
) -> dict[str, int]:
    """Bytes of the fused loss (``fused.fused_draft_loss``) beyond its inputs, on ``rows`` loss rows of a
    step of ``queries`` block rows in chunks of ``chunk`` rows, by item (the planner's loss phase).

    ``dh_s`` ``[N, H]`` fp32 over all ``N = queries`` rows (the op's outputs have static shapes; twice
    with CAP), and each chunk's ``[c, H]`` fp32 ``G @ W`` before it lands there. Per chunk, with
    ``kernel`` (the native CPU kernel or Triton's, ``fused.planned_epilogue``): the raw student and teacher logits and G, ``[c, V]``
    in the head dtype, and ``G @ W``'s ``[c, H]`` output before its fp32 copy. Without (the eager
    passes): the reused fp32 ``[c, V]`` buffers ``zs`` and ``p``, ``zt`` when teacher states are given,
    ``q`` with KL, and the largest transient of the chunk loop: the bf16 logits GEMM before its fp32
    copy, ``torch.linalg.vecdot``'s elementwise product (entropy, KL cross term), ``logsumexp``'s
    internal exp and the temperature-scaled copies, ``p``'s bf16 copy for ``G @ W``. Both: for CAP the
    correct rows' logits, their ``logsumexp``, ``exp`` and bf16 copy. ``correct_fraction`` is the share
    of chunk rows whose argmax is already right (CAP's extra work; 1.0, the worst case, for planning).
    This is the loss's ``c*V*16..20`` eager, ``c*V*6`` (bf16) to ``c*V*12`` (fp32) with a kernel, plus
    those transients."""
    n = rows
    f, t = 4, head_bytes
    kernel = kernel and tv_weight == 0  # TV's gradient runs in the eager passes (loss.fused)
    c = max(1, min(chunk, n))
    cv = c * vocab
    cap = 0
    if cap_weight > 0:
        nc = int(round(c * correct_fraction))
        cap = nc * vocab * (2 * f + (t if t != f else 0))  # g = zs[idx], then exp / logsumexp, bf16 copy
    dh = queries * hidden * f * (2 if cap_weight > 0 else 1)
    dh_chunk = c * hidden * f
    bias = {}
    if bias_rank:  # a low-rank logit bias (chunks.ChunkBias): d e [N, r] and d W2 [V, r] in fp32 (twice with CAP), the chunk's [c, r] G @ W2
        r, twice = bias_rank, (2 if cap_weight > 0 else 1)
        bias = {"markov bias gradients": twice * (queries + vocab) * r * f + c * r * f}
    # per-row pair terms (overlap, Renyi-1/2, a block credit): no buffer in a kernel (its scratch is a
    # few rows per thread), one more [c, V] buffer in the eager passes; ``kernel`` says which will run.
    if kernel:
        buffers = (2 + (1 if teacher else 0)) * cv * t + (c * hidden * t if t != f else 0) + dh_chunk
        return {"dh": dh, "chunk buffers": buffers, "chunk transient": cap, **bias}
    per_row = per_row_terms or tv_weight > 0
    buffers = 2 + (1 if teacher else 0) + (1 if kl_weight > 0 else 0) + (1 if per_row else 0)
    gemm = cv * t if t != f else 0
    vecdot = cv * f
    temp = 0
    if kl_weight > 0 and temperature != 1.0:
        temp = 2 * cv * f  # log_pt and its logsumexp
    if cap_temperature != 1.0:
        temp = max(temp, 2 * cv * f)
    grad_copy = cv * t if t != f else 0
    if bias_rank and t != f:
        gemm *= 2  # the bf16 GEMM output and the bias term added to it before the fp32 copy
    tv = cv * (f + 1) if tv_weight > 0 else 0  # TV's bool mask and its gradient beside Renyi's
    transient = max(gemm, vecdot, temp, grad_copy, cap, tv)
    return {"dh": dh, "chunk buffers": buffers * cv * f + dh_chunk, "chunk transient": transient, **bias}
