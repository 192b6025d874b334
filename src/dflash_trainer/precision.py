"""Which training precision a device does well: bf16 autocast where it has bf16 GEMMs, else fp32.

Under ``train.dtype=bfloat16`` the drafter runs under autocast with fp32 master weights (parameters,
gradients and AdamW states stay fp32), and the loss's three head GEMMs run in bf16 with fp32 logits
and softmax (``training.step.draft_loss``). That pays only where bf16 GEMMs are native: CUDA GPUs
from Ampere on, x86 CPUs with AVX512-BF16 or AMX, Arm CPUs with the BF16 extension. Elsewhere
oneDNN emulates bf16 and it is slower than fp32.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def onednn_allows_bf16() -> bool:
    """oneDNN (torch's CPU GEMMs) is not held below bf16 instructions by ``ONEDNN_MAX_CPU_ISA``
    (``DNNL_MAX_CPU_ISA``): set to AVX2 or AVX512_CORE, say, it emulates bf16 on any CPU."""
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return isa == "ALL" or isa.startswith("AVX10") or any(k in isa for k in ("BF16", "AMX", "FP16"))


def cpu_has_bf16_gemm() -> bool:
    """This CPU multiplies bf16 natively (AVX512-BF16 / AMX on x86, BF16 on Arm), and oneDNN may use it."""
    if not onednn_allows_bf16():
        return False
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return True
    try:  # aarch64 lists "bf16" among its features
        return any(
            line.startswith("Features") and " bf16" in f" {line.split(':', 1)[-1]}"
            for line in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


def preferred_train_dtype(device_type: str = "cpu") -> str:
    """``train.dtype`` to use on ``device_type``: "bfloat16" where bf16 GEMMs are native, else "float32"."""
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_bf16_gemm() else "float32"


def muon_ns_dtype(device_type: str = "cpu") -> torch.dtype:
    """The dtype of Muon's Newton-Schulz iteration on ``device_type``: bf16 (torch.optim.Muon's) on CUDA
    and on CPUs with bf16 GEMMs, fp32 on other CPUs (emulated bf16 GEMMs are 20x slower there)."""
    if device_type == "cuda" or (device_type == "cpu" and cpu_has_bf16_gemm()):
        return torch.bfloat16
    return torch.float32
