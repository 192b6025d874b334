"""GPU memory presets: what ``topology.gpu`` may name, validated by the schema and priced by the planner."""

from __future__ import annotations

from ..errors import UserError

GB = 1e9
MIB = 2**20

# GPU memory as the driver reports it (nvidia-smi's MiB); the planner subtracts the CUDA context and an
# allocator margin itself. Values are per GPU.
GPU_PRESETS: dict[str, tuple[int, str]] = {
    "rtx-pro-6000": (97_887 * MIB, "NVIDIA RTX PRO 6000 Blackwell (96 GB class)"),
    "h100": (81_559 * MIB, "NVIDIA H100 80GB"),
    "h200": (143_771 * MIB, "NVIDIA H200 141GB"),
    "a100-80gb": (81_920 * MIB, "NVIDIA A100 80GB"),
    "l40s": (46_068 * MIB, "NVIDIA L40S 48GB"),
}


def gpu_memory(spec: str | int | float) -> tuple[int, str]:
    """``(bytes, description)`` of a GPU preset name or a size in GB (decimal, e.g. ``95`` or ``"95"``)."""
    if isinstance(spec, str) and spec.strip().lower() in GPU_PRESETS:
        return GPU_PRESETS[spec.strip().lower()]
    try:
        gb = float(spec)
    except (TypeError, ValueError):
        raise UserError(
            f"unknown GPU {spec!r}: give a memory size in GB (e.g. 95) or one of {', '.join(GPU_PRESETS)}"
        ) from None
    if not gb > 0:
        raise UserError(f"GPU memory must be > 0 GB, got {spec!r}")
    return int(gb * GB), f"{gb:g} GB device"
