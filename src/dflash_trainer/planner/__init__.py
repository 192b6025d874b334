"""The memory planner: what a DFlash training run needs on each device, before anything is allocated.

    from dflash_trainer.planner import plan_for_config, render_text
    plan = plan_for_config(cfg, target="qwen3.6-27b", gpu="rtx-pro-6000", target_gpus=7)
    print(render_text(plan))

``formulas`` holds one named formula per thing that takes memory (mirroring the code), ``plan``
assembles them per device and phase, ``report`` renders a plan, ``preflight`` is what
``dflash-train train`` runs first. ``benchmarks/planner_measure.py`` measures real CPU steps
against it (a calibration tool, not part of the installed package).
"""

from .formulas import DrafterDims, Workload, drafter_param_count, loss_workspace
from .plan import DevicePlan, Item, Plan, Topology, make_plan
from .report import plan_for_config, render_json, render_text, workload_from_config
from .shapes import GPU_PRESETS, TARGET_PRESETS, TargetShape, gpu_memory, load_target_shape, target_param_count

__all__ = [
    "GPU_PRESETS",
    "TARGET_PRESETS",
    "DevicePlan",
    "DrafterDims",
    "Item",
    "Plan",
    "TargetShape",
    "Topology",
    "Workload",
    "drafter_param_count",
    "gpu_memory",
    "load_target_shape",
    "loss_workspace",
    "make_plan",
    "plan_for_config",
    "render_json",
    "render_text",
    "target_param_count",
    "workload_from_config",
]
