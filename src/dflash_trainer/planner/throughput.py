"""Throughput of the disaggregated topology: which role is the bottleneck, and which split is best.

Per packed row of L tokens (n = max_anchors blocks of B slots, Q = n*B query rows):

    target rank   body forward: 2 * P_body * L  +  full-attention scores 2 * 2 * L * (L/2) * heads * head_dim
                  per full-attention layer (causal, one document per row: an upper bound)
    drafter rank  forward + backward (x3, x4 with activation checkpointing) of the layers on Q rows,
                  their k/v projections of the L context rows, fc (k*H -> H) on L rows (no input
                  gradient: x2), attention of Q queries over (L/2 + B) keys; plus the fused loss,
                  6 * n*(B-1) * H * V (4 without a teacher)
    link          bytes one row puts on the wire into its drafter rank (``bytes_per_row``)

Time per row on a role = FLOPs / (peak bf16 FLOP/s * utilization); the run's rows/s is the minimum of
``T / t_target``, ``D / t_drafter`` and ``D * link / bytes``: the role that sets it is the bottleneck.
The peaks are datasheet dense bf16 tensor-core rates (approximate; ``utilization`` absorbs the rest).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import formulas as F
from .shapes import TargetShape, target_param_count

# Dense bf16 tensor-core peak (FLOP/s) and the link into one GPU (bytes/s), per GPU preset.
GPU_PEAKS: dict[str, tuple[float, float, str]] = {
    "rtx-pro-6000": (500e12, 50e9, "PCIe Gen5 x16"),  # 4 PFLOPS sparse FP4 / 8
    "h100": (989e12, 450e9, "NVLink 4"),
    "h200": (989e12, 450e9, "NVLink 4"),
    "a100-80gb": (312e12, 300e9, "NVLink 3"),
    "l40s": (362e12, 25e9, "PCIe Gen4 x16"),
}
DEFAULT_UTILIZATION = 0.4


def bytes_per_row(s: TargetShape, w: F.Workload) -> int:
    """What a target rank sends for one row: context features, teacher rows at the blocks, ints."""
    t = F.DTYPE_BYTES[w.target_dtype]
    context = w.seq_len * w.num_features * s.hidden_size * t
    teacher = w.max_anchors * w.block_size * s.hidden_size * t if w.need_teacher else 0
    ints = 8 * (3 * w.seq_len + w.max_anchors) + 80
    return context + teacher + ints


def target_flops_per_row(s: TargetShape, w: F.Workload, layer_ids: list[int]) -> float:
    """The body forward up to the last hooked layer (all layers when the teacher is needed)."""
    embed_and_head = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    body = target_param_count(s) - embed_and_head
    layers_run = s.num_layers if w.need_teacher else max(layer_ids) + 1
    share = layers_run / s.num_layers
    full = sum(t != "linear_attention" for t in s.layer_types[:layers_run])
    attention = full * 2 * 2 * w.seq_len * (w.seq_len / 2) * s.num_heads * s.head_dim
    return 2 * body * share * w.seq_len + attention


def drafter_flops_per_row(s: TargetShape, w: F.Workload) -> dict[str, float]:
    """``{"drafter", "loss"}``: forward + backward FLOPs of the drafter layers and of the fused loss."""
    d = F.DrafterDims.of(s)
    passes = 4 if w.activation_checkpointing else 3
    q, length, h = w.queries, w.seq_len, d.hidden
    layers = w.drafter_layers * (
        passes * 2 * F.drafter_matmul_params(d) * q  # projections and MLP on the block rows
        + passes * 2 * 2 * h * d.kvd * length  # each layer's k/v projections of the context rows
        + passes * 2 * 2 * q * (length / 2 + w.block_size) * d.qd  # scores and values
    )
    fc = 2 * 2 * w.num_features * h * h * length  # forward + weight gradient (the features need none)
    rows = w.max_anchors * (w.block_size - 1)
    loss = (6 if w.need_teacher else 4) * rows * h * d.vocab
    return {"drafter": layers + fc, "loss": loss}


@dataclass(frozen=True)
class Throughput:
    target_ranks: int
    drafter_ranks: int
    target_s_per_row: float  # one target rank's time for one row
    drafter_s_per_row: float  # one drafter rank's time for one row (layers + loss)
    link_s_per_row: float
    bytes_per_row: int
    rows_per_s: float
    tokens_per_s: float
    bottleneck: str  # "target", "drafter" or "link"

    def as_dict(self) -> dict:
        return asdict(self)


def throughput(
    s: TargetShape,
    w: F.Workload,
    layer_ids: list[int],
    target_ranks: int,
    drafter_ranks: int,
    *,
    peak_flops: float,
    link_bytes_per_s: float,
    utilization: float = DEFAULT_UTILIZATION,
) -> Throughput:
    """Rows and tokens per second of T target + D drafter ranks. ``target_ranks == 0``: one process does
    both, one row after the other."""
    rate = peak_flops * utilization
    t_target = target_flops_per_row(s, w, layer_ids) / rate
    t_drafter = sum(drafter_flops_per_row(s, w).values()) / rate
    nbytes = bytes_per_row(s, w)
    if target_ranks == 0:
        rows_s, bottleneck, t_link = drafter_ranks / (t_target + t_drafter), "single process", 0.0
    else:
        t_link = nbytes / link_bytes_per_s
        limits = {
            "target": target_ranks / t_target,
            "drafter": drafter_ranks / t_drafter,
            "link": drafter_ranks / t_link,
        }
        bottleneck = min(limits, key=limits.get)
        rows_s = limits[bottleneck]
    return Throughput(
        target_ranks, drafter_ranks, t_target, t_drafter, t_link, nbytes, rows_s, rows_s * w.seq_len, bottleneck
    )


def best_split(s: TargetShape, w: F.Workload, layer_ids: list[int], gpus: int, **kwargs) -> Throughput:
    """The target:drafter split of ``gpus`` processes with the most tokens/s (ties: fewer drafter ranks)."""
    if gpus < 2:
        raise ValueError("a split needs at least 2 GPUs")
    options = [throughput(s, w, layer_ids, t, gpus - t, **kwargs) for t in range(gpus - 1, 0, -1)]
    return max(options, key=lambda x: x.tokens_per_s)


def vllm_capture(
    s: TargetShape,
    w: F.Workload,
    layer_ids: list[int],
    gpus_per_server: int,
    *,
    peak_flops: float,
    utilization: float = DEFAULT_UTILIZATION,
    **_,
) -> dict:
    """Tokens/s of one vLLM capture server of ``gpus_per_server`` GPUs (its target forward split evenly
    over them: ideal tensor parallel scaling, an upper bound) and of one drafter GPU training from the
    cache, and how many servers keep one drafter GPU busy."""
    rate = peak_flops * utilization
    server = gpus_per_server * rate / target_flops_per_row(s, w, layer_ids) * w.seq_len
    drafter = rate / sum(drafter_flops_per_row(s, w).values()) * w.seq_len
    return {
        "gpus_per_server": gpus_per_server,
        "server_tokens_per_s": server,
        "drafter_tokens_per_s": drafter,
        "servers_per_drafter_gpu": drafter / server,
    }
