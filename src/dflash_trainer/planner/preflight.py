"""The preflight of ``dflash-train train``: plan this launch before anything large is allocated.

One process (``topology.target_ranks`` 0) runs the target and the drafter together, on the CPU,
planned against the memory the OS reports as available. A torchrun launch is planned as launched:
T target ranks and D drafter ranks, each against its GPU's memory (on CUDA) or its share of the
machine's available memory (gloo on the CPU); every rank plans the same and refuses with the same line. A run predicted not to fit is refused
with the table and the recommendation, unless ``topology.preflight`` is false. When ``loss.chunk_size``
is not set, the loss chunk becomes the one the planner derives from the memory left at the loss phase.
"""

from __future__ import annotations

import sys

from ..errors import UserError
from .plan import Plan, Topology, make_plan
from .report import available_ram, render_text, workload_from_config
from .shapes import GB, load_target_shape

FALLBACK_CHUNK = 1024  # loss rows per chunk when the planner cannot derive one (preflight off)


def process_topology(cfg) -> Topology:
    """Where this launch trains: one CPU process, or ``target_ranks`` + ``drafter_ranks`` processes."""
    import torch

    t, d = cfg.topology.target_ranks, cfg.topology.drafter_ranks
    if t and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return Topology(
            memory=props.total_memory,
            device_name=props.name,
            device="cuda",
            target_gpus=t,
            drafter_gpus=d,
            allocator_margin=cfg.topology.allocator_margin,
        )
    return Topology(
        memory=available_ram() // (t + d if t else 1),
        device_name="this machine's RAM (available)" + (f", shared by {t + d} processes" if t else ""),
        device="cpu",
        target_gpus=t,
        drafter_gpus=d if t else 1,
        allocator_margin=cfg.topology.allocator_margin,
        cpu_threads=torch.get_num_threads(),
    )


def plan_this_process(cfg, topology: Topology | None = None) -> Plan:
    from ..model.loading import resolve_target_path

    folder = resolve_target_path(cfg.target.path)  # the same clear error as loading would give
    shape = load_target_shape(str(folder))
    if cfg.target.layer_ids and any(not 0 <= i < shape.num_layers for i in cfg.target.layer_ids):
        raise UserError(
            f"target.layer_ids {cfg.target.layer_ids} are out of range for the {shape.num_layers}-layer "
            f"target at {folder}"
        )
    return make_plan(shape, workload_from_config(cfg), topology or process_topology(cfg), cfg.target.layer_ids)


def preflight(cfg, *, topology: Topology | None = None, out=None):
    """Return ``cfg`` with ``loss.chunk_size`` filled in; raise ``UserError`` if the run is predicted not to
    fit and ``topology.preflight`` is on. Prints one line (or the whole plan when it does not fit)."""
    out = out or sys.stdout
    if not cfg.topology.preflight:
        # off means off: a target the planner cannot price (an unusual config) must still train
        from ..model.loading import resolve_target_path

        resolve_target_path(cfg.target.path)  # a missing target folder: the same error loading would give
        try:
            plan = plan_this_process(cfg, topology)
        except Exception as exc:  # the planner does not understand this config
            chunk = cfg.loss.chunk_size or FALLBACK_CHUNK
            print(
                f"warning: preflight: the planner cannot price this target ({type(exc).__name__}: {exc}); "
                f"topology.preflight is false, running with loss chunk {chunk:,}",
                file=out,
            )
            cfg = cfg.model_copy(deep=True)
            cfg.loss.chunk_size = chunk
            return cfg
    else:
        plan = plan_this_process(cfg, topology)
    dev = next((d for d in plan.devices if not d.fits), plan.devices[-1])
    if not plan.fits:
        out.write(render_text(plan))
        msg = (
            f"preflight: the planner predicts {dev.total / GB:.2f} GB at the {dev.peak_phase} phase, more than the "
            f"{dev.capacity / GB:.2f} GB available on each {dev.role} ({plan.topology.device_name.split(' (')[0]}); "
            "see the plan above"
        )
        if cfg.topology.preflight:
            raise UserError(msg + " (set topology.preflight=false to run anyway)")
        print(f"warning: {msg}; topology.preflight is false, running anyway", file=out)
    else:
        print(
            f"preflight: predicted peak {dev.total / GB:.2f} GB at the {dev.peak_phase} phase, of "
            f"{dev.capacity / GB:.2f} GB available; loss chunk {plan.chunk:,} rows"
            + (" (derived; set loss.chunk_size to choose)" if cfg.loss.chunk_size is None else ""),
            file=out,
        )
    if cfg.loss.chunk_size is None:
        cfg = cfg.model_copy(deep=True)
        cfg.loss.chunk_size = plan.chunk
    out.flush()
    return cfg


__all__ = ["plan_this_process", "preflight", "process_topology"]
