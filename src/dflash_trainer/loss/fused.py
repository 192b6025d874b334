"""The fused draft loss: CE + soft KL + CAP from hidden states, never materializing ``[N, V]``.

A ``torch.library`` custom op (``dflash_trainer::fused_draft_loss``, its backward a second op, both
with fake implementations for meta and fake tensors, so that ``torch.compile(fullgraph=True)`` and
memory traces see through a step) walks the rows in chunks of ``c``. Per chunk it computes the student
and teacher logits in fp32 (fp64 for fp64 inputs), the loss terms, and the closed-form gradient with
respect to the student logits (shared/DESIGN.md section 3):

    G_i = w_i [ (1-a)(p_i - e_y) + a T (p_i^T - q_i^T) ] / sum w  -  (lambda / n_correct) / Tc * pc_i (log pc_i + H_i)

then writes ``dh_s[chunk] = G @ W`` (``dh_s`` spans all N rows, zero where the weight is 0, so the op's
outputs have static shapes; chain rule through the target's logit scale and softcap
included). Backward only returns ``grad_output * dh_s``: the head is frozen, so there is no weight
gradient, and the GEMM work is 6NHV FLOPs in all (student logits, teacher logits, G @ W).

Memory beyond the inputs: ``dh_s`` (``N*H*4`` bytes, twice with CAP, whose normalization by the
global number of correct rows is only known after the last chunk) plus, per chunk, three fp32
``[c, V]`` buffers and one transient (four buffers with KL at T != 1): ``c*V*16`` to ``c*V*20``
bytes, about the ``c*V*18`` of DESIGN.md; CAP's correct-row subset and a bf16 head's GEMM output
reach ``c*V*26`` at worst. Softcap adds one transient in the gradient.

Three implementations of a chunk's element-wise work, same math, tested equal in float64:

- ``_eager_chunk``: separate eager passes (max, exp, sums, the gradient update in place), about a
  dozen reads or writes of each ``[c, V]`` buffer. Any device.
- the native CPU kernel (``loss/native.py``, ``kernels/chunk_epilogue.cpp``): the GEMMs write raw
  logits in the head's dtype; one row at a time, in the core's cache, it computes one exponential per
  logit and distribution and writes G in the head's dtype for the last GEMM. Built once per machine
  with the system's C++ compiler (about a second). The CPU default: with a bf16 head the exponentials
  are what is left once the GEMMs run at bf16 speed.
- the Triton kernel (``loss/triton_epilogue.py``): the same row-resident passes for CUDA. The GPU default.

The two kernels keep ``c*V*12`` bytes of buffers with an fp32 head, ``c*V*6`` with bf16, plus the
same CAP subset. DSpark's per-row terms (acceptance, Renyi-1/2, D-PARD credit) run in the kernels'
row passes and in the eager passes. Where a kernel cannot run (no C++ compiler, no triton) the loss
runs the eager passes (the native kernel warns once). ``torch.compile``'s inductor used to be a fourth
implementation; it was slower than the native kernel at every measured shape and dtype on the CPU
(``benchmarks/results/loss_efficiency.md``: 46-58% of the GEMM floor in fp32 against 74-79%, 15-29%
in bf16 against 46-64%) and needs what the two kernels need (a C++ compiler, triton), so it was removed.

DFlash2's candidates (``top_k`` K > 0): each row's K largest transformed student logits and their ids
come out of the same chunk loop, so that the candidate selector only ever sees ``[N, K]``. The native
kernel selects them in its row pass from the block maxima its first pass already has (it reads only
the few blocks of the row that hold them; no extra ``[c, V]`` buffer); the eager passes run
``torch.topk`` over the chunk's transformed logits, and after the Triton kernel a
``torch.topk`` reads the chunk's raw-logit buffer once more (then K values per row are transformed).
The loss and its gradient do not depend on ``top_k`` (bit-identical). Measured at V = 151,936, K = 16
(``benchmarks/results/loss_topk.md``, 2 CPU threads): the native kernel's chunk time grows by about
1-2% (fp32 and bf16), the loss's forward+backward by less than the noise; a ``torch.topk`` over the
CPU chunk alone costs about 0.8-0.9x the whole native kernel, which is why the kernel selects inline.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from . import native

# Bytes per chunk element that the chunk loop keeps alive at its worst, used to size chunks from a
# byte budget: 16-20 for the common cases above, 24 for KL at T != 1 and 26 for CAP with every row
# correct and a bf16 head (the subset buffers and the bf16 GEMM output), as the planner's allocator
# log measured; the budget must hold in the worst case.
BYTES_PER_CHUNK_ELEMENT = 26
DEFAULT_MEMORY_BUDGET = 256 * 2**20  # 256 MiB of chunk workspace when neither chunk_size nor budget is given
COMPILE_ENV = "DFLASH_LOSS_COMPILE"  # "0" / "1" / "native" / "triton" override compile="auto"


@dataclass(frozen=True)
class LossTerms:
    kl_weight: float = 0.0
    temperature: float = 1.0
    cap_weight: float = 0.0
    cap_temperature: float = 1.0
    label_source: str = "data"  # "data" or "teacher"
    logit_scale: float = 1.0
    softcap: float | None = None
    # DSpark's terms (``fused_draft_loss``'s docstring): per-row acceptance a = sum_v min(p_v, q_v),
    # the Renyi-1/2 actor -2 log sum_v sqrt(p_v q_v) and the D-PARD credit weights.
    renyi_weight: float = 0.0
    acceptance: bool = False
    dpard: bool = False
    dpard_alpha: float = 0.5
    # DFlash2's candidates: each row's top_k largest transformed student logits and their ids (0: off)
    top_k: int = 0
    # D-PACE position weights: the block credit of the student's detached label probability p(y)
    dpace: bool = False
    dpace_alpha: float = 0.5
    # total variation 1 - sum_v min(p_v, q_v) between student and teacher at T = 1 (eager passes only)
    tv_weight: float = 0.0

    @property
    def per_row_terms(self) -> bool:
        """Whether the chunk computes a and the Renyi term (student and teacher at T = 1)."""
        return self.acceptance or self.renyi_weight > 0 or self.dpard or self.tv_weight > 0

    @property
    def block_credit(self) -> bool:
        """Whether the rows' coefficients are a block credit (D-PARD's or D-PACE's), not their weights."""
        return self.dpard or self.dpace

    @property
    def credit_alpha(self) -> float:
        return self.dpard_alpha if self.dpard else self.dpace_alpha


@dataclass
class ChunkBias:
    """The Markov bias of one chunk, a rank-r term of the same logits: ``z = h W^T + e W2^T``.

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


def _logits(
    h: torch.Tensor | None, weight: torch.Tensor, t: LossTerms, out: torch.Tensor | None, bias: ChunkBias | None = None
) -> torch.Tensor | None:
    """``[c, H] -> [c, V]`` logits in ``out``'s dtype (fp32/fp64), scaled and soft-capped in place;
    ``bias`` adds the Markov term to the raw logits first (the same GEMM pass, never ``[N, V]``).

    ``out`` is a reused workspace buffer: fresh multi-MB allocations per chunk would page-fault."""
    if h is None:
        return None
    if weight.dtype == out.dtype:
        z = torch.mm(h, weight.T, out=out)
        if bias is not None:
            bias.add_to(z)
    else:  # the GEMM runs in the head's dtype (bf16); logits are upcast per chunk
        raw = h @ weight.T
        if bias is not None:
            bias.add_to(raw)
        z = out.copy_(raw)
    if t.logit_scale != 1.0:
        z.mul_(t.logit_scale)
    if t.softcap:
        z.div_(t.softcap).tanh_().mul_(t.softcap)
    return z


def _chain_to_raw(g: torch.Tensor, z: torch.Tensor, t: LossTerms) -> torch.Tensor:
    """Turn a gradient w.r.t. transformed logits ``z`` into one w.r.t. raw logits, in place."""
    if t.softcap:
        factor = z / t.softcap  # d(cap*tanh(r/cap))/dr = 1 - tanh^2 = 1 - (z/cap)^2
        g.mul_(factor.square_().neg_().add_(1.0))
        del factor
    if t.logit_scale != 1.0:
        g.mul_(t.logit_scale)
    return g


def _eager_chunk(
    hs_rows, ht_rows, weight, y_data, coef, t: LossTerms, buffers, dh_rows, bias=None, credit=None, extra=None
):
    """One chunk in separate eager passes over fp32 (fp64) ``[c, V]`` buffers; writes ``G @ W`` into ``dh_rows``.

    Returns ``(lse, z_y, s_arg, t_arg, entropy, kl, logits_of)``, all ``[c]`` but ``logits_of``, which
    gives the transformed logits of some rows (valid until the next chunk). Live ``[c, V]`` buffers:
    student logits ``zs``, student probabilities ``p`` (turned into the gradient in place), teacher
    logits (turned into ``q`` in place), the tempered student log-probabilities when T != 1, and one
    transient (logsumexp / entropy reductions). DSpark's per-row terms (``t.per_row_terms``) add one
    buffer ``r`` (teacher probabilities, then sqrt(p q), then the Renyi gradient) and one transient;
    ``credit`` turns the chunk's acceptance ``[c]`` into its rows' coefficients (D-PARD), and
    ``extra`` (a dict) receives ``accept``, ``renyi`` and ``coef`` ``[c]``, and with ``t.top_k`` K > 0
    ``topk`` = (logits ``[c, K]``, ids ``[c, K]``) of ``torch.topk`` over the transformed logits.
    """
    a, temp, tc = t.kl_weight, t.temperature, t.cap_temperature
    zs = _logits(hs_rows, weight, t, buffers["zs"], bias)  # [c, V]
    m_s, s_arg = zs.max(-1)  # one pass gives the shift for a stable softmax and the argmax
    if t.top_k and extra is not None:  # zs is never written in place below: any point would do
        extra["topk"] = tuple(torch.topk(zs, t.top_k, dim=-1))
    p = torch.sub(zs, m_s[:, None], out=buffers["p"]).exp_()
    sum_s = p.sum(-1)
    lse = m_s + sum_s.log()  # [c]
    p.mul_(sum_s.reciprocal()[:, None])  # student probabilities
    zt = _logits(ht_rows, weight, t, buffers["zt"]) if ht_rows is not None else None
    t_arg = None
    if zt is not None:
        m_t, t_arg = zt.max(-1)
    y = t_arg if t.label_source == "teacher" else y_data
    z_y = zs.gather(1, y[:, None]).squeeze(1)
    if t.dpace:  # D-PACE: the credit of the detached label probability, before any term's gradient uses coef
        coef = credit(torch.exp(z_y - lse))
    renyi_g = None
    if t.per_row_terms:  # at T = 1, before the KL pass turns zt into q^T in place
        pt = torch.sub(zt, m_t[:, None], out=buffers["r"]).exp_()
        pt.mul_(pt.sum(-1).reciprocal()[:, None])  # teacher probabilities
        accept = torch.minimum(p, pt).sum(-1)  # a = sum_v min(p_v, q_v)
        below = (p < pt) if (t.tv_weight > 0 and dh_rows is not None) else None  # TV's mask, bool [c, V]
        bc = pt.mul_(p).sqrt_().sum(-1)  # Bhattacharyya coefficient sum_v sqrt(p_v q_v)
        if t.dpard:
            coef = credit(accept)
        extra.update(accept=accept, renyi=-2.0 * bc.log(), coef=coef)
        if t.renyi_weight > 0 and dh_rows is not None:
            # d(-2 log BC)/dz_v = p_v - sqrt(p_v q_v) / BC, weighted like the other terms
            renyi_g = pt.mul_(bc.reciprocal()[:, None]).neg_().add_(p).mul_((t.renyi_weight * coef)[:, None])
        if below is not None:
            # TV = 1 - a: d(1 - sum_u min(p_u, q_u))/dz_v = p_v (S - m_v), m_v = [p_v < q_v], S = sum_u m_u p_u.
            # Built in the teacher buffer when Renyi does not hold it, else as one transient added to Renyi's.
            mp = torch.mul(p, below, out=None if renyi_g is not None else pt)
            below = None
            scale, below_mass = t.tv_weight * coef, mp.sum(-1)  # [c]: the weight and S
            mp.mul_((-scale)[:, None]).addcmul_(p, (scale * below_mass)[:, None])
            renyi_g = renyi_g.add_(mp) if renyi_g is not None else mp
            mp = None
        pt = None
    elif extra is not None:
        extra.update(coef=coef)
    if a == 0:
        zt = None  # the teacher logits were only needed for labels and agreement

    # CAP statistic: entropy of softmax(z / Tc) (the mask `correct` carries no gradient).
    if tc == 1.0:
        entropy = lse - torch.linalg.vecdot(p, zs)
    else:
        pc = zs / tc
        pc.sub_(torch.logsumexp(pc, -1, keepdim=True))  # log pc
        entropy = -torch.linalg.vecdot(pc.exp(), pc)
        del pc

    # Soft KL at temperature T: KL(q^T || p^T) = sum q log q - sum q log p^T.
    kl = torch.zeros_like(lse)
    if a > 0:
        u = zt.sub_(m_t[:, None])  # shifted teacher logits, in place
        if temp != 1.0:
            u.div_(temp)
        q = torch.exp(u, out=buffers["q"])
        sum_t = q.sum(-1)
        neg_entropy_q = u.mul_(q).sum(-1) / sum_t - sum_t.log()  # u is not needed after this
        q.mul_(sum_t.reciprocal()[:, None])  # teacher q^T
        zt = u = None
        if temp == 1.0:
            log_pt = None
            cross = torch.linalg.vecdot(q, zs) - lse
        else:
            log_pt = zs / temp
            log_pt.sub_(torch.logsumexp(log_pt, -1, keepdim=True))
            cross = torch.linalg.vecdot(q, log_pt)
        kl = neg_entropy_q - cross

    if dh_rows is not None:
        # p becomes G in place: w [ (1-a)(p - e_y) + a T (p^T - q^T) ] / sum w
        if a > 0 and temp == 1.0:  # p^T = p: G = coef (p - a q) - (1-a) coef e_y
            p.mul_(coef[:, None]).addcmul_(q, coef[:, None], value=-a)
        else:
            p.mul_(((1 - a) * coef)[:, None])
            if a > 0:
                pt_minus_q = log_pt.exp_().sub_(q)
                p.addcmul_(pt_minus_q, coef[:, None], value=a * temp)
        p.scatter_add_(1, y[:, None], (-(1 - a) * coef)[:, None])
        if renyi_g is not None:
            p.add_(renyi_g)
        q = log_pt = pt_minus_q = renyi_g = None
        _chain_to_raw(p, zs, t)
        if weight.dtype == dh_rows.dtype:
            torch.mm(p, weight, out=dh_rows)
        else:
            dh_rows.copy_(p.to(weight.dtype).matmul(weight))
        if bias is not None:
            bias.backward(p)
    return lse, z_y, s_arg, t_arg, entropy, kl, lambda idx: zs[idx]


def _kernel_chunk(
    epilogue, hs_rows, ht_rows, weight, y_data, coef, t: LossTerms, buffers, dh_rows, bias=None, credit=None, extra=None
):
    """One chunk with a kernel for the element-wise work: the logit GEMMs in the head's dtype (the
    Markov ``bias`` added to the raw student logits), then ``epilogue`` (``_native_epilogue``,
    or ``_triton_epilogue``: row terms, G in the head's dtype), then ``G @ W``
    (and the bias's gradients). Same returns as ``_eager_chunk``; None if the epilogue failed to
    compile (the caller then runs the eager passes).

    DSpark's per-row terms (``t.per_row_terms``) come out of the same
    row pass: acceptance and Renyi value per row, the Renyi gradient inside G. With D-PARD a row's
    coefficient is its block's credit, known only once the kernel has the acceptance of all the
    block's rows: the kernel then writes G with coefficient 1, and the credit scales G's rows on the
    small sides of the GEMMs that follow (``[c, H]``, ``[c, r]``), never as another pass over G.

    DFlash2's candidates (``t.top_k`` K > 0) go to ``extra["topk"]`` (logits ``[c, K]``, ids ``[c, K]``):
    the native kernel selects them in its row pass; after the Triton kernel a
    ``torch.topk`` reads the chunk's raw-logit buffer once more and the K values are transformed
    (the transform is monotone: increasing, or decreasing for a negative logit scale)."""
    zs_raw = torch.mm(hs_rows, weight.T, out=buffers["zs"])  # [c, V] untransformed
    if bias is not None:
        bias.add_to(zs_raw)
    zt_raw = torch.mm(ht_rows, weight.T, out=buffers["zt"]) if ht_rows is not None else None
    g = buffers["g"] if dh_rows is not None else None
    out = epilogue(zs_raw, zt_raw, y_data, torch.ones_like(coef) if credit is not None else coef, g, t)
    if out is None:
        return None
    if t.top_k:
        if epilogue is _native_epilogue:
            *out, top_ids, top_logits = out
        else:
            top_raw, top_ids = torch.topk(zs_raw, t.top_k, dim=-1, largest=t.logit_scale >= 0)
            top_logits = _transformed(top_raw.to(coef.dtype), t)
        extra["topk"] = (top_logits, top_ids)
    if t.per_row_terms:
        *out, accept, renyi = out
        if t.dpard:
            coef = credit(accept)
        extra.update(accept=accept, renyi=renyi)
    if t.dpace:  # out[0], out[1]: the rows' lse and z_y, so p(y) = exp(z_y - lse)
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
        return _transformed(zs_raw[idx].to(coef.dtype), t)

    return (*out, logits_of)


def _native_epilogue(zs_raw, zt_raw, y, coef, g_out, t: LossTerms):
    """The row-resident CPU kernel (``loss/native.py``): row terms (with DSpark's per-row terms,
    acceptance and Renyi after them; then DFlash2's top-K ids and logits), G in ``g_out``."""
    return native.chunk_epilogue(
        zs_raw,
        zt_raw,
        y,
        coef,
        g_out,
        t.kl_weight,
        t.temperature,
        t.cap_temperature,
        t.logit_scale,
        t.softcap,
        t.renyi_weight,
        t.per_row_terms,
        t.top_k,
    )


def _transformed(z: torch.Tensor, t: LossTerms) -> torch.Tensor:
    """The target's logit transform (``loss.logits.transform_logits``), out of place."""
    if t.logit_scale != 1.0:
        z = z * t.logit_scale
    if t.softcap:
        z = t.softcap * torch.tanh(z / t.softcap)
    return z


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


def _triton_epilogue(zs_raw, zt_raw, y, coef, g_out, t: LossTerms):
    """The Triton kernel (``loss/triton_epilogue.py``): row terms (and DSpark's per-row terms), G in ``g_out``."""
    return triton_epilogue().chunk_epilogue(
        zs_raw,
        zt_raw,
        y,
        coef,
        g_out,
        t.kl_weight,
        t.temperature,
        t.cap_temperature,
        t.logit_scale,
        t.softcap,
        t.renyi_weight,
        t.per_row_terms,
    )


_NATIVE_WARNED = False


def _warn_native_unavailable() -> None:
    global _NATIVE_WARNED
    if not _NATIVE_WARNED:
        _NATIVE_WARNED = True
        warnings.warn(
            f"fused_draft_loss: the CPU kernel could not be built ({native.BUILD_ERROR}); using another implementation",
            stacklevel=4,
        )


EPILOGUES = {"native": _native_epilogue, "triton": _triton_epilogue, "eager": None}


@torch.no_grad()
def _run_chunks(
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
    compiled,
    keep,
    rows_in,
    bias_rows=None,
    bias_weight=None,
    block_ids=None,
):
    """The chunk loop. Inputs ``[n, ...]`` are already compacted to the rows with weight > 0; ``keep``
    ``[n]`` says where each of them sits among the ``rows_in`` (N) rows of the call.

    Returns ``(loss, stats, dh, extras)`` where ``stats`` is ``[num_slots or 1, 9]`` float64 sums of
    (rows, ce, kl, entropy of correct rows, correct, agreement, label probability, acceptance, Renyi)
    and ``dh`` ``[N, H]`` is the gradient of the loss w.r.t. the uncompacted student rows, zero at
    weight-0 rows (None unless ``want_grad``). ``compiled`` is the chunk epilogue kernel to use
    (``EPILOGUES``; None: the eager passes of ``_eager_chunk``). ``bias_rows`` ``[n, r]`` and
    ``bias_weight`` ``[V, r]`` are the Markov bias (``ChunkBias``); ``block_ids`` ``[n]`` (D-PARD) keeps
    every block inside one chunk. ``extras``: ``accept`` ``[N]`` (with per-row terms), ``dbias_rows``
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
    bounds = _chunk_bounds(n, chunk, block_ids)
    c_max, vocab = max(b.stop - b.start for b in bounds), weight.shape[0]

    def chunk_buffers(for_compiled: bool) -> dict[str, torch.Tensor]:
        if for_compiled:  # raw GEMM outputs, G and G @ W, all in the head's dtype: the kernel upcasts as it reads
            needed = (("zs", vocab, True), ("zt", vocab, ht is not None), ("g", vocab, want_grad))
            needed += (("dh", hidden, want_grad and weight.dtype != f),)
            dtype = weight.dtype
        else:
            needed = (("zs", vocab, True), ("p", vocab, True), ("zt", vocab, ht is not None), ("q", vocab, a > 0))
            needed += (("r", vocab, t.per_row_terms),)
            dtype = f
        return {name: torch.empty(c_max, cols, dtype=dtype, device=dev) for name, cols, need in needed if need}

    buffers = chunk_buffers(compiled is not None)
    dh_chunk = torch.empty(c_max, hidden, dtype=f, device=dev) if want_grad else None
    rank = bias_rows.shape[1] if bias_rows is not None else 0
    de_chunk = torch.empty(c_max, rank, dtype=f, device=dev) if (want_grad and rank) else None
    de = torch.zeros(rows_in, rank, dtype=f, device=dev) if de_chunk is not None else None
    dw2 = torch.zeros(vocab, rank, dtype=f, device=dev) if de_chunk is not None else None
    de_cap = torch.zeros(rows_in, rank, dtype=f, device=dev) if (de is not None and dh_cap is not None) else None
    dw2_cap = torch.zeros(vocab, rank, dtype=f, device=dev) if de_cap is not None else None
    accept_rows = torch.zeros(rows_in, dtype=f, device=dev) if t.per_row_terms else None
    topk_ids = torch.full((rows_in, t.top_k), -1, dtype=torch.int64, device=dev)
    topk_logits = torch.full((rows_in, t.top_k), -torch.inf, dtype=f, device=dev)
    inv_rows = 1.0 / n  # D-PARD: sum_t W_t l_t / (rows with loss), as speculators normalizes its credit

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
        if t.block_credit:
            credit = _block_credit(block_ids[rows], t.credit_alpha, inv_rows)
        extra = {}
        args = (hs[rows], ht_rows, weight, y_data, coef, t, {k: b[:c] for k, b in buffers.items()}, dh_rows)
        out = _kernel_chunk(compiled, *args, bias, credit, extra) if compiled is not None else None
        if out is None:  # the eager passes; from here on also where the kernel failed to compile
            if compiled is not None:
                compiled, buffers = None, chunk_buffers(False)
                args = (*args[:6], {k: b[:c] for k, b in buffers.items()}, dh_rows)
            out = _eager_chunk(*args, bias, credit, extra)
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
        row_loss = (1 - a) * ce + a * temp**2 * kl
        renyi = extra.get("renyi")
        if t.renyi_weight > 0:
            row_loss = row_loss + t.renyi_weight * renyi
        if t.tv_weight > 0:
            row_loss = row_loss + t.tv_weight * (1.0 - extra["accept"])
        loss_main += (coef * row_loss).double().sum()
        accept = extra.get("accept")
        if accept_rows is not None:
            accept_rows.index_copy_(0, keep[rows], accept)
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
            _chain_to_raw(g, z_idx, t)
            dh_cap[keep[rows.start + idx]] = g.to(weight.dtype).matmul(weight).to(f)
            if de_cap is not None:  # the entropy's gradient reaches the Markov bias too
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
                accept if accept is not None else torch.zeros_like(ce),
                renyi if renyi is not None else torch.zeros_like(ce),
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
    extras = {"accept": accept_rows, "dbias_rows": de, "dbias_weight": dw2}
    extras.update(topk_ids=topk_ids, topk_logits=topk_logits)
    return loss, stats, dh, extras


def _chunk_bounds(n: int, chunk: int, block_ids: torch.Tensor | None) -> list[slice]:
    """Row ranges of at most ``chunk`` rows; with ``block_ids`` ``[n]`` (rows of one block are
    contiguous) a range ends at a block boundary, so that a block's D-PARD credit is computed in one
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


def _block_credit(block_ids: torch.Tensor, alpha: float, inv_rows: float):
    """``x [c] -> coef [c]``: the block credit of each row, detached, over whole blocks, from a per-row
    confidence ``x`` in [0, 1]: the acceptance a (D-PARD) or the label probability p(y) (D-PACE).

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


STATS_COLUMNS = 9


# The loss as torch.library custom ops: opaque to torch.compile (no graph break: dynamo records one
# call), with fake implementations that give the outputs' shapes on meta and fake tensors (tracing,
# memory traces), and the autograd formula registered beside them. Outputs have static shapes: the
# compaction to weight > 0 rows happens inside, and dh spans every row.
OP_NAMESPACE = "dflash_trainer"


def _loss_forward(
    hs: torch.Tensor,
    ht: torch.Tensor | None,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    weights: torch.Tensor,
    slot_ids: torch.Tensor | None,
    num_slots: int,
    kl_weight: float,
    temperature: float,
    cap_weight: float,
    cap_temperature: float,
    label_source: str,
    logit_scale: float,
    softcap: float | None,
    chunk: int,
    policy: str,
    want_grad: bool,
    bias_rows: torch.Tensor | None = None,
    bias_weight: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    renyi_weight: float = 0.0,
    acceptance: bool = False,
    dpard: bool = False,
    dpard_alpha: float = 0.5,
    top_k: int = 0,
    dpace: bool = False,
    dpace_alpha: float = 0.5,
    tv_weight: float = 0.0,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """``(loss [], stats [max(num_slots, 1), 9] float64, dh [N, H] or [0, H], accept [N] or [0],
    dbias_rows [N, r] or [0, r], dbias_weight [V, r] or [0, r], topk_ids [N, K] int64,
    topk_logits [N, K])`` of ``hs`` ``[N, H]``, K = ``top_k`` (0: both ``[N, 0]``).

    ``num_slots`` 0: no slots; ``policy`` is ``fused_draft_loss``'s ``compile`` as a string ("auto",
    "native", "triton", "true", "false"); ``dh`` (fp32, fp64 for fp64 inputs) is d loss / d hs, zero
    at weight-0 rows, when ``want_grad``; likewise the Markov bias's gradients. ``accept`` is the
    per-row acceptance (0 at weight-0 rows) when DSpark's per-row terms are on. The value checks that
    need the data run here."""
    n, hidden = hs.shape
    f = torch.promote_types(hs.dtype, torch.float32)
    rank = bias_rows.shape[1] if bias_rows is not None else 0
    _check_values(weights, labels, slot_ids, num_slots, weight.shape[0], label_source)
    terms = LossTerms(
        kl_weight,
        temperature,
        cap_weight,
        cap_temperature,
        label_source,
        logit_scale,
        softcap,
        renyi_weight,
        acceptance,
        dpard,
        dpard_alpha,
        top_k,
        dpace,
        dpace_alpha,
        tv_weight,
    )
    keep = (weights > 0).nonzero().squeeze(1)  # compaction: weight-0 rows cost nothing
    grad_rows = n if (want_grad and rank) else 0
    if keep.numel() == 0:
        dh = torch.zeros(n if want_grad else 0, hidden, dtype=f, device=hs.device)
        stats = hs.new_zeros(max(num_slots, 1), STATS_COLUMNS, dtype=torch.float64)
        accept = hs.new_zeros(n if terms.per_row_terms else 0, dtype=f)
        de = hs.new_zeros(grad_rows, rank, dtype=f)
        dw2 = hs.new_zeros(weight.shape[0] if grad_rows else 0, rank, dtype=f)
        top_ids = torch.full((n, top_k), -1, dtype=torch.int64, device=hs.device)
        top_logits = torch.full((n, top_k), -torch.inf, dtype=f, device=hs.device)
        return hs.new_zeros((), dtype=f), stats, dh, accept, de, dw2, top_ids, top_logits
    compile = {"true": True, "false": False}.get(policy, policy)
    kind = epilogue_kind(compile, hs.device, hs.dtype)
    if tv_weight > 0:  # the kernels have no TV gradient: its few extra passes run eager
        kind = "eager"
    compiled = EPILOGUES[kind]
    loss, stats, dh, extras = _run_chunks(
        hs.index_select(0, keep),
        ht.index_select(0, keep) if ht is not None else None,
        weight,
        labels.index_select(0, keep).long() if label_source == "data" else None,
        weights.index_select(0, keep),
        slot_ids.index_select(0, keep).long() if num_slots else None,
        num_slots or None,
        terms,
        chunk,
        want_grad,
        compiled,
        keep,
        n,
        bias_rows.index_select(0, keep) if rank else None,
        bias_weight if rank else None,
        block_ids.index_select(0, keep) if (terms.block_credit and block_ids is not None) else None,
    )
    if dh is None:
        dh = torch.empty(0, hidden, dtype=f, device=hs.device)
    accept = extras["accept"] if extras["accept"] is not None else hs.new_zeros(0, dtype=f)
    de = extras["dbias_rows"] if extras["dbias_rows"] is not None else hs.new_zeros(0, rank, dtype=f)
    dw2 = extras["dbias_weight"] if extras["dbias_weight"] is not None else hs.new_zeros(0, rank, dtype=f)
    return loss.to(f), stats, dh, accept, de, dw2, extras["topk_ids"], extras["topk_logits"]


fused_draft_loss_op = torch.library.custom_op(f"{OP_NAMESPACE}::fused_draft_loss", _loss_forward, mutates_args=())


@fused_draft_loss_op.register_fake
def _(hs, ht, weight, labels, weights, slot_ids, num_slots, *rest):
    """Shapes and dtypes only (meta and fake tensors: tracing, torch.compile, memory traces)."""
    want_grad, bias_rows = rest[9], (rest[10] if len(rest) > 10 else None)
    per_row = (len(rest) > 13 and rest[13] > 0) or (len(rest) > 14 and rest[14]) or (len(rest) > 15 and rest[15])
    per_row = per_row or (len(rest) > 20 and rest[20] > 0)  # tv_weight
    f = torch.promote_types(hs.dtype, torch.float32)
    n, rank = hs.shape[0], (bias_rows.shape[1] if bias_rows is not None else 0)
    grad_rows = n if (want_grad and rank) else 0
    top_k = rest[17] if len(rest) > 17 else 0
    stats = hs.new_empty(max(num_slots, 1), STATS_COLUMNS, dtype=torch.float64)
    return (
        hs.new_empty((), dtype=f),
        stats,
        hs.new_empty(n if want_grad else 0, hs.shape[1], dtype=f),
        hs.new_empty(n if per_row else 0, dtype=f),
        hs.new_empty(grad_rows, rank, dtype=f),
        hs.new_empty(weight.shape[0] if grad_rows else 0, rank, dtype=f),
        hs.new_empty(n, top_k, dtype=torch.int64),
        hs.new_empty(n, top_k, dtype=f),
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
    bias_rows, bias_weight = (inputs[17], inputs[18]) if len(inputs) > 18 else (None, None)
    ctx.bias_dtypes = (bias_rows.dtype, bias_weight.dtype) if bias_rows is not None else None
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(output[2], output[4], output[5])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_loss, *_grad_outputs):
    dh, de, dw2 = ctx.saved_tensors
    grads = [fused_draft_loss_backward_op(dh, grad_loss, ctx.hs_dtype)] + [None] * (ctx.num_inputs - 1)
    if ctx.bias_dtypes is not None and de.shape[0]:  # the Markov bias: features and W2
        grads[17] = fused_draft_loss_backward_op(de, grad_loss, ctx.bias_dtypes[0])
        grads[18] = fused_draft_loss_backward_op(dw2, grad_loss, ctx.bias_dtypes[1])
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
    *,
    kl_weight: float = 0.0,
    temperature: float = 1.0,
    cap_weight: float = 0.0,
    cap_temperature: float = 1.0,
    label_source: str = "data",
    logit_scale: float = 1.0,
    softcap: float | None = None,
    slot_ids: torch.Tensor | None = None,
    num_slots: int | None = None,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
    compile: bool | str = "auto",
    bias_rows: torch.Tensor | None = None,
    bias_weight: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    renyi_weight: float = 0.0,
    acceptance: bool = False,
    dpard: bool = False,
    dpard_alpha: float = 0.5,
    top_k: int = 0,
    dpace: bool = False,
    dpace_alpha: float = 0.5,
    tv_weight: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """The draft loss of ``student_hidden`` against ``teacher_hidden`` through the frozen head.

    Shapes: ``student_hidden`` and ``teacher_hidden`` ``[N, H]`` (the teacher row i is the target's
    final-normed hidden state that predicts the same token as student row i), ``lm_head_weight``
    ``[V, H]``, ``labels`` ``[N]`` token ids (ignored with ``label_source="teacher"``), ``weights``
    ``[N]`` >= 0 (rows with weight 0 cost nothing), ``slot_ids`` ``[N]`` in ``0..num_slots-1``.
    ``teacher_hidden`` may be None for CE with data labels (the teacher GEMM is then skipped).

    Returns ``(loss, metrics)``: a scalar (fp32, fp64 for fp64 inputs) that backpropagates into
    ``student_hidden`` only, and detached metrics: ``ce``, ``kl``, ``cap``, ``accuracy`` (student argmax
    equals label), ``agreement`` (student argmax equals teacher argmax), ``label_prob``, ``rows``,
    ``correct``; with ``slot_ids`` also ``per_slot`` tensors ``[num_slots]`` of the same.

    ``compile``: run each chunk's element-wise work in a kernel: "native" (the CPU kernel), "triton"
    (the CUDA kernel), True (the device's kernel), or as separate eager passes (False); "auto" (the
    default) chooses, see ``epilogue_kind``. All give the same results (tested in float64); a kernel
    that cannot be built falls back to another implementation with one warning.

    DSpark (``variants/dspark.py``), all off by default:

    - ``bias_rows`` ``[N, r]`` and ``bias_weight`` ``[V, r]`` (same dtype as the head): the Markov
      logit bias, ``z_i = h_i W^T + e_i W2^T``, a rank-r term added to each chunk's raw logits in the
      same GEMM pass (never ``[N, V]``); both receive gradients (``W2``'s accumulated chunk by chunk).
    - ``acceptance``: the per-row acceptance ``a_i = sum_v min(p_v, q_v)`` of the student p and the
      teacher q at T = 1, returned detached as ``metrics["accept_rows"]`` ``[N]`` (0 at weight-0 rows).
    - ``renyi_weight`` beta: adds ``beta * (-2 log sum_v sqrt(p_v q_v))`` (Renyi divergence of order
      1/2, Bhattacharyya form) to each row's loss, weighted like the other terms.
    - ``dpard`` (needs ``block_ids`` ``[N]``, a block's rows contiguous in slot order): the rows'
      weights become the detached D-PARD credit ``W_t = sum_{k>=t} prod_{i<=k} s_i``,
      ``s_i = dpard_alpha + (1 - dpard_alpha) a_i`` over the block's rows with weight > 0, and the
      loss is ``sum_t W_t l_t / (rows with weight > 0)`` (speculators' normalization).

    Position weights and terms for every variant:

    - ``dpace`` (D-PACE, arXiv 2605.18810; needs ``block_ids`` like ``dpard``): the same block credit
      with ``s_i = dpace_alpha + (1 - dpace_alpha) p_i(y_i)``, the student's detached probability of
      the row's label, in place of the weights (which then only select the rows with loss); no teacher
      needed. Computed from each row's logsumexp and label logit, so every kernel runs it.
    - ``tv_weight``: adds ``tv_weight * (1 - a_i)``, the total variation between student and teacher
      at T = 1 (``1 - sum_v min(p_v, q_v) = 0.5 sum_v |p_v - q_v|``), to each row's loss, weighted
      like the other terms. Its gradient runs in the eager passes (one more bool and one fp32
      ``[c, V]`` transient); needs the teacher.

    These per-row terms need the teacher. They are computed in the chunk's row pass with the other
    terms: in the native CPU kernel (the CPU's default), the Triton kernel (CUDA's) and the eager
    passes.

    ``top_k`` K in ``[0, V]`` (DFlash2's candidates, 0 by default): the metrics gain ``topk_ids``
    ``[N, K]`` int64 and ``topk_logits`` ``[N, K]`` (fp32, fp64 for fp64 inputs; detached): each row's K
    largest student logits as the loss uses them (logit scale, softcap and the Markov bias applied),
    sorted descending, with their token ids; ids -1 and logits -inf at rows with weight 0. Ties come in
    the order of ``torch.topk`` (the native kernel: lower id first). Selected per chunk inside the loss
    pass, never from ``[N, V]``; the loss, its gradients and the other metrics are unchanged. Cost: in
    the native kernel a selection over the few blocks of each row that can hold the top K (the block
    maxima come from a pass it makes anyway), about 1-2% of its chunk time at V = 151,936; elsewhere
    one ``torch.topk`` per chunk over ``[c, V]`` (on the CPU about as much again as the native kernel).
    ``loss.candidates.candidate_logits`` re-gathers these logits with a gradient to the hidden states.
    """
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
    _check("label_source", label_source in ("data", "teacher"), "'data' or 'teacher'", repr(label_source))
    _check("kl_weight", 0.0 <= kl_weight <= 1.0, "in [0, 1]", kl_weight)
    _check("temperature", temperature > 0, "> 0", temperature)
    _check("cap_temperature", cap_temperature > 0, "> 0", cap_temperature)
    _check("cap_weight", cap_weight >= 0, ">= 0", cap_weight)
    _check("softcap", softcap is None or softcap > 0, "None or > 0", softcap)
    if ht is None:
        _check(
            "teacher_hidden",
            kl_weight == 0 and label_source == "data",
            "given when kl_weight > 0 or label_source='teacher'",
            None,
        )
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
    if label_source == "data":
        _check(
            "labels",
            labels is not None and labels.shape == (n,) and not labels.is_floating_point(),
            f"an integer [{n}] tensor",
            None if labels is None else f"{tuple(labels.shape)} {labels.dtype}",
        )
    if slot_ids is not None:
        _check("num_slots", num_slots is not None and num_slots >= 1, "given with slot_ids", num_slots)
        _check("slot_ids", slot_ids.shape == (n,), f"[{n}] ids in [0, {num_slots})", tuple(slot_ids.shape))
    _check(
        "compile",
        compile in COMPILE_CHOICES,
        "'auto', True, False, 'native' or 'triton'",
        repr(compile),
    )
    per_row = acceptance or renyi_weight > 0 or dpard or tv_weight > 0
    _check("renyi_weight", renyi_weight >= 0, ">= 0", renyi_weight)
    _check("tv_weight", tv_weight >= 0, ">= 0", tv_weight)
    _check("dpard_alpha", 0.0 < dpard_alpha <= 1.0, "in (0, 1]", dpard_alpha)
    _check("dpace_alpha", 0.0 < dpace_alpha <= 1.0, "in (0, 1]", dpace_alpha)
    _check("dpace", not (dpace and dpard), "off with dpard (both are a block credit: choose one)", dpace)
    _check("teacher_hidden", not per_row or ht is not None, "given for acceptance, Renyi, D-PARD or TV", None)
    _check(
        "top_k",
        isinstance(top_k, int) and not isinstance(top_k, bool) and 0 <= top_k <= vocab,
        f"an int in [0, {vocab}] (the vocabulary)",
        repr(top_k),
    )
    credit = dpard or dpace
    _check(
        "block_ids",
        not credit or (block_ids is not None and block_ids.shape == (n,)),
        f"[{n}] with dpard or dpace",
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
    loss, stats, _, accept, _, _, topk_ids, topk_logits = fused_draft_loss_op(
        hs,
        ht,
        w_head.detach(),
        labels if label_source == "data" else None,
        weights,
        slot_ids,
        num_slots if slot_ids is not None else 0,
        kl_weight,
        temperature,
        cap_weight,
        cap_temperature,
        label_source,
        logit_scale,
        softcap,
        chunk_rows(vocab, chunk_size, memory_budget),
        policy,
        torch.is_grad_enabled() and (hs.requires_grad or (bias_rows is not None and bias_rows.requires_grad)),
        bias_rows,
        bias_weight,
        block_ids.long() if block_ids is not None else None,
        renyi_weight,
        acceptance,
        dpard,
        dpard_alpha,
        top_k,
        dpace,
        dpace_alpha,
        tv_weight,
    )
    metrics = _metrics(stats, ht is not None, slot_ids is not None, per_row)
    if tv_weight > 0:
        metrics["tv"] = 1.0 - metrics["accept"]
    if per_row:
        metrics["accept_rows"] = accept
    if top_k:
        metrics["topk_ids"], metrics["topk_logits"] = topk_ids, topk_logits
    return loss, metrics


_COLUMNS = ("rows", "ce", "kl", "entropy", "correct", "agreement", "label_prob", "accept", "renyi")


def _metrics(stats: torch.Tensor, has_teacher: bool, per_slot: bool, per_row: bool = False) -> dict:
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
        if per_row:
            out["accept"] = s[..., 7] / rows
            out["renyi"] = s[..., 8] / rows
        return out

    metrics = summarize(stats.sum(0))
    if per_slot:
        metrics["per_slot"] = summarize(stats)
    return metrics
