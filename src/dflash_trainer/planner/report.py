"""``dflash-train plan``: resolve a run's config, target and topology; render the plan as a table or JSON.

dflash-train plan --config ddtree-experiment                     # the preset's own topology
dflash-train plan --config baseline-v6 --gpu h100 --target-gpus 7
dflash-train plan --config ddtree-experiment --naive             # without this project's fixes
dflash-train plan --target qwen3-8b --gpu 80 --set data.max_anchors=2048 --json
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from ..errors import UserError
from ..variants import variant_of
from . import formulas as F
from .plan import Plan, Topology, _target_layer_ids, make_plan, vllm_gpus
from .shapes import GB, TARGET_PRESETS, TargetShape, gpu_memory, load_target_shape, target_param_count
from .throughput import DEFAULT_UTILIZATION, GPU_PEAKS, best_split, throughput, vllm_capture


def workload_from_config(cfg) -> F.Workload:
    """The planner's view of a ``RunConfig``."""
    d, lo, tr = cfg.drafter, cfg.loss, cfg.train
    variant_terms = variant_of(d.variant).planner_terms(d.variant_settings)
    return F.Workload(
        seq_len=cfg.data.seq_len,
        max_anchors=cfg.data.max_anchors,
        prefetch=cfg.topology.prefetch,
        block_size=d.block_size,
        num_features=cfg.target.num_feature_layers,
        drafter_layers=d.num_layers,
        drafter_intermediate=d.intermediate_size,
        sliding_window_layers=tuple(d.sliding_window_layers),
        causal_in_block_sliding=d.causal_in_block_sliding,
        attention_backend=d.attention_backend,
        train_dtype=tr.dtype,
        target_dtype=cfg.target.dtype,
        noise=d.noise != "none" and d.noise_scale > 0,
        kl_weight=lo.kl_weight,
        tv_weight=lo.tv_weight,
        temperature=lo.temperature,
        cap_weight=lo.cap_weight,
        cap_temperature=lo.cap_temperature,
        labels=lo.labels,
        optimizer=tr.optimizer,
        chunk_size=lo.chunk_size,
        grad_accum=tr.grad_accum,
        activation_checkpointing=d.activation_checkpointing,
        need_teacher_layers=lo.kl_weight > 0
        or lo.labels == "teacher"
        or lo.tv_weight > 0
        or variant_terms["variant_teacher"],
        **variant_terms,
        rollout_tokens=(
            cfg.data.seq_len + cfg.on_policy.max_new_tokens + d.block_size if tr.stage == "on_policy" else 0
        ),
        rollout_tree_budget=cfg.on_policy.budget if cfg.on_policy.rollout == "ddtree" else 0,
    )


def target_shape_for(cfg, override: str | None = None) -> TargetShape:
    """``--target``, else ``target.path`` ('tiny' or a model folder), else ``topology.target_model``."""
    spec = override or cfg.target.path or cfg.topology.target_model
    if spec is None:
        raise UserError(
            "no target to plan for: pass --target (built-in: "
            + ", ".join(TARGET_PRESETS)
            + "; or a model folder / config.json) or set target.path or topology.target_model"
        )
    return load_target_shape(spec)


def machine_memory() -> tuple[int, str, str]:
    """``(bytes, description, device)`` of this process's training device: the first CUDA GPU if there is
    one, else the memory the OS reports as available."""
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return int(p.total_memory), p.name, "cuda"
    except Exception:  # pragma: no cover - a broken CUDA install still plans the CPU
        pass
    return available_ram(), "this machine's RAM (available)", "cpu"


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def topology_for(
    cfg, gpu: str | None = None, target_gpus: int | None = None, drafter_gpus: int | None = None
) -> Topology:
    t = cfg.topology
    spec = gpu if gpu is not None else t.gpu
    if spec == "auto":
        memory, name, device = machine_memory()
    else:
        memory, name = gpu_memory(spec)
        device = "cuda"
    offline = bool(cfg.data.features)  # the drafter reads cached features: no target body is loaded
    tg = (0 if offline else t.target_ranks) if target_gpus is None else target_gpus
    dg = t.drafter_ranks if drafter_gpus is None else drafter_gpus
    if tg < 0 or dg < 1:
        raise UserError(f"--target-gpus must be >= 0 and --drafter-gpus >= 1, got {tg} and {dg}")
    return Topology(
        memory=memory,
        device_name=name,
        device=device,
        target_gpus=tg,
        drafter_gpus=dg,
        allocator_margin=t.allocator_margin,
        offline=offline,
    )


def plan_for_config(
    cfg,
    *,
    target: str | None = None,
    gpu: str | None = None,
    target_gpus: int | None = None,
    drafter_gpus: int | None = None,
    naive: bool = False,
    topology: Topology | None = None,
) -> Plan:
    """Plan a resolved ``RunConfig`` (overrides as on the command line)."""
    shape = target_shape_for(cfg, target)
    if cfg.target.layer_ids:
        bad = [i for i in cfg.target.layer_ids if not 0 <= i < shape.num_layers]
        if bad:
            raise UserError(
                f"target.layer_ids {bad} are out of range for the {shape.num_layers}-layer target {shape.name}"
            )
    topo = topology or topology_for(cfg, gpu, target_gpus, drafter_gpus)
    w = workload_from_config(cfg)
    plan = make_plan(shape, w, topo, cfg.target.layer_ids, naive=naive)
    spec = (gpu if gpu is not None else cfg.topology.gpu).strip().lower()
    if topo.target_gpus and spec in GPU_PEAKS and not naive:
        peak, link, link_name = GPU_PEAKS[spec]
        ids = _target_layer_ids(shape, w, cfg.target.layer_ids)
        kwargs = dict(peak_flops=peak, link_bytes_per_s=link, utilization=DEFAULT_UTILIZATION)
        plan.throughput = {
            "gpu": spec,
            "peak_flops": peak,
            "link_bytes_per_s": link,
            "link": link_name,
            "utilization": DEFAULT_UTILIZATION,
            "as_launched": throughput(shape, w, ids, topo.target_gpus, topo.drafter_gpus, **kwargs).as_dict(),
            "best_split": best_split(shape, w, ids, topo.target_gpus + topo.drafter_gpus, **kwargs).as_dict(),
        }
        v = cfg.capture.vllm
        configured = v.tensor_parallel_size * v.pipeline_parallel_size
        if cfg.capture.engine == "vllm" or not plan.devices[0].fits and plan.devices[0].role == "target GPU":
            gpus = configured if cfg.capture.engine == "vllm" else max(configured, vllm_gpus(shape, w, topo))
            plan.throughput["vllm_capture"] = vllm_capture(shape, w, ids, gpus, **kwargs)
    plan.data = data_cost(w.seq_len)
    plan.capture = capture_cost(cfg, shape, w)
    return plan


def _cache_rows(cfg) -> tuple[int | None, str]:
    """``(rows, where from)`` of the configured data, when known without tokenizing: a feature cache's or
    a prepared folder's manifest (``data.features`` / ``data.prepared``), or the data cache's."""
    for key, name in (("features", "manifest.json"), ("prepared", "manifest.json")):
        folder = getattr(cfg.data, key)
        if folder:
            try:
                m = json.loads((Path(folder) / name).read_text())
                splits = m["splits"]
                n = (
                    splits["train"] + splits["eval"]
                    if key == "features"
                    else splits["train"]["rows"] + splits["eval"]["rows"]
                )
                return int(n), f"data.{key} {folder}"
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return _prepared_cache_rows(cfg)


def _prepared_cache_rows(cfg) -> tuple[int | None, str]:
    """Rows of the configured data when ``train`` already prepared it into the data cache (the target
    folder's tokenizer gives the cache key; nothing is tokenized here)."""
    if not cfg.data.train_files or not cfg.target.path:
        return None, ""
    try:
        from ..data.prepare import cache_root, request_for
        from ..model.loading import load_target_config

        text_cfg, tokenizer, _ = load_target_config(cfg.target.path)
        request = request_for(cfg.data, tokenizer, text_cfg.vocab_size, min_tokens=cfg.drafter.block_span + 1)
        root = Path(cfg.data.cache_dir or cache_root())  # as data.prepare.ensure_prepared finds it
        m = json.loads((root / request.key() / "manifest.json").read_text())
        return m["splits"]["train"]["rows"] + m["splits"]["eval"]["rows"], f"prepared data {root / request.key()}"
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return None, ""


def capture_cost(cfg, s, w: F.Workload) -> dict:
    """What ``dflash-train capture`` of this config writes and what reading it costs: bytes per token
    and per row for each storage dtype, the corpus total when its row count is known, and the reading
    side's host RAM (one stored row, decoded in the target dtype)."""
    from ..features.codec import STORAGE_DTYPES
    from ..features.store import row_bytes

    teacher = cfg.capture.teacher if cfg.capture.teacher is not None else w.need_teacher
    storage = cfg.capture.dtype or w.target_dtype
    per_row = {d: row_bytes(w.seq_len, s.hidden_size, w.num_features, d, teacher) for d in STORAGE_DTYPES}
    rows, source = _cache_rows(cfg)
    decoded = w.seq_len * s.hidden_size * (w.num_features + int(teacher)) * w.t
    return {
        "storage_dtype": storage,
        "teacher": teacher,
        "seq_len": w.seq_len,
        "bytes_per_row": per_row,
        "bytes_per_token": {d: b / w.seq_len for d, b in per_row.items()},
        "rows": rows,
        "rows_source": source,
        "corpus_bytes": per_row[storage] * rows if rows is not None else None,
        "reader_ram_bytes": per_row[storage] + decoded,
        "window": cfg.data.feature_window,
        # a shard holds as many rows as fit capture.shard_bytes, at least one (features.capture.capture_plan)
        "window_bytes": (
            cfg.data.feature_window * max(1, cfg.capture.shard_bytes // per_row[storage]) * per_row[storage]
            if cfg.data.feature_window
            else None
        ),
    }


def data_cost(seq_len: int) -> dict:
    """What the prepared data (``data.storage``) costs: disk per token, document and row, RAM per row."""
    from ..data import storage

    return {
        "disk_bytes_per_token": storage.DISK_BYTES_PER_TOKEN,
        "disk_bytes_per_document": storage.DISK_BYTES_PER_DOCUMENT,
        "disk_bytes_per_row": storage.DISK_BYTES_PER_ROW,
        "disk_bytes_per_full_row": seq_len * storage.DISK_BYTES_PER_TOKEN + storage.DISK_BYTES_PER_ROW,
        "ram_bytes_per_row": storage.RAM_BYTES_PER_ROW,
        "seq_len": seq_len,
    }


# -- rendering -----------------------------------------------------------------------------------

_UNIT = [GB, "GB"]


def _gb(b: int | float) -> str:
    return f"{b / _UNIT[0]:,.2f}"


def _pick_unit(plan: Plan) -> None:
    """GB for GPU-sized plans, MB (1e6 bytes) when everything is under 2 GB (the tiny CPU runs)."""
    biggest = max(max(d.total, d.capacity if d.capacity < 1 << 60 else 0) for d in plan.devices)
    _UNIT[:] = [GB, "GB"] if biggest >= 2 * GB else [1e6, "MB"]


def _terms(w: F.Workload) -> str:
    parts = ["CE" if w.kl_weight < 1 else ""]
    if w.kl_weight > 0:
        parts.append(f"{w.kl_weight:.0%} KL")
    if w.tv_weight > 0:
        parts.append("TV")
    if w.cap_weight > 0:
        parts.append("CAP")
    return " + ".join(p for p in parts if p)


def _capture_lines(c: dict) -> list[str]:
    per_row, per_token = c["bytes_per_row"], c["bytes_per_token"]
    what = "context features" + (" + last hidden (teacher)" if c["teacher"] else "")
    dtypes = [d for d in ("bfloat16", "float8_e4m3", "float32") if d in per_row]
    lines = [
        f"feature cache (dflash-train capture, {what}): "
        + ", ".join(
            f"{d} {per_token[d]:,.0f} bytes/token ({per_row[d] / 1e9:,.2f} GB per {c['seq_len']:,}-token row)"
            for d in dtypes
        )
    ]
    rows = c["rows"]
    if rows is not None:
        lines.append(
            f"  this data ({rows:,} rows, {c['rows_source']}): {c['corpus_bytes'] / 1e9:,.1f} GB on disk in "
            f"{c['storage_dtype']} (capture.dtype)"
        )
    else:
        lines.append(
            f"  {c['storage_dtype']}: {per_row[c['storage_dtype']] * 10_000 / 1e12:,.2f} TB per 10,000 rows (this data's "
            "row count is known once it is prepared: dflash-train prepare-data --out DIR, then data.prepared=DIR)"
        )
    if c.get("window"):
        lines.append(
            f"  as a window (data.feature_window={c['window']}, capture and train at once): at most "
            f"{c['window_bytes'] / 1e9:,.1f} GB of training shards on disk"
        )
    lines.append(
        f"  reading it (train --set data.features=DIR): {c['reader_ram_bytes'] / 1e9:,.2f} GB of host RAM "
        "per drafter rank (one stored row and its decoded copy)"
    )
    return lines


def render_text(plan: Plan) -> str:
    s, w, topo = plan.target, plan.workload, plan.topology
    _pick_unit(plan)
    unit = _UNIT[1]
    lines = []
    kind = "pipeline WITHOUT this project's fixes (--naive)" if plan.naive else "memory plan"
    lines.append(
        f"{kind}: target {s.name} ({s.num_layers} layers, hidden {s.hidden_size:,}, vocabulary "
        f"{s.vocab_size:,}, {w.target_dtype})"
    )
    where = (
        f"{topo.target_gpus} target GPU{'s' if topo.target_gpus > 1 else ''} + {topo.drafter_gpus} drafter GPU"
        f"{'s' if topo.drafter_gpus > 1 else ''}"
        if topo.target_gpus
        else f"drafter only, features from the cache (data.features), no target body{' (x' + str(topo.drafter_gpus) + ')' if topo.drafter_gpus > 1 else ''}"
        if topo.offline
        else f"target and drafter on one device{' (x' + str(topo.drafter_gpus) + ')' if topo.drafter_gpus > 1 else ''}"
    )
    each = " each" if topo.target_gpus or topo.drafter_gpus > 1 else ""
    lines.append(f"topology: {where}; {topo.device_name}, {_gb(topo.memory)} {unit}{each}")
    lines.append(
        f"step: rows of {w.seq_len:,} tokens, {w.max_anchors:,} anchors x block {w.block_size} = "
        f"{w.queries:,} query positions, {w.drafter_layers} drafter layers ({w.attention_backend} attention"
        f"{', checkpointed' if w.activation_checkpointing else ''}), {w.train_dtype} compute, {_terms(w)}; "
        + (
            "loss on full [positions x vocab] tensors"
            if plan.naive
            else f"loss chunk {plan.chunk:,} rows ({plan.chunk_source})"
        )
    )
    for dev in plan.devices:
        lines.append("")
        head = f"{dev.role} (x{dev.count})" if dev.count > 1 else dev.role
        lines.append(f"{head:<48s}{unit:>9s}   peak phase: {dev.peak_phase}")
        starred = False
        for it in dev.items:
            mark = " " if it.name in dev.in_peak else "*"
            starred |= mark == "*"
            lines.append(f"  {it.name:<45s}{_gb(it.bytes):>9s}{mark}  {it.note}".rstrip())
        if dev.runtime:
            lines.append(f"  {'CUDA runtime reserve':<45s}{_gb(dev.runtime):>9s}   context, cuBLAS/NCCL workspaces")
        lines.append(
            f"  {'allocator margin':<45s}{_gb(dev.margin):>9s}   {topo.allocator_margin:.0%} of the tensor peak"
        )
        verdict = "fits" if dev.fits else "DOES NOT FIT"
        lines.append(
            f"  {'total':<45s}{_gb(dev.total):>9s}   of {_gb(dev.capacity)} {unit}: {verdict} "
            f"({_gb(abs(dev.headroom))} {unit} {'free' if dev.fits else 'over'})"
        )
        lines.append("  phases: " + ", ".join(f"{k} {_gb(v)}" for k, v in dev.phases.items()) + f" {unit} (tensors)")
        if starred:
            lines.append("  * not alive at the peak phase; its largest size in another phase")
    if plan.throughput:
        lines.append("")
        lines.extend(_throughput_lines(plan))
    if plan.data:
        d = plan.data
        lines.append("")
        lines.append(
            f"data (prepared once, memory-mapped by every rank): {d['disk_bytes_per_token']} bytes/token on disk + "
            f"{d['disk_bytes_per_document']} per document, {d['disk_bytes_per_full_row'] / 1e6:,.2f} MB per "
            f"{d['seq_len']:,}-token row ({d['disk_bytes_per_token']} GB per billion tokens); "
            f"RAM: {d['ram_bytes_per_row']} bytes per row and rank, whatever the corpus (page cache aside)"
        )
    if plan.capture:
        lines.append("")
        lines.extend(_capture_lines(plan.capture))
    lines.append("")
    if plan.fits:
        lines.append(
            "verdict: FITS on every device"
            + (" (prediction; on GPUs nothing was measured)" if topo.device == "cuda" else "")
        )
    else:
        bad = [d for d in plan.devices if not d.fits]
        lines.append(
            "verdict: DOES NOT FIT: "
            + "; ".join(f"{d.role} needs {_gb(d.total)} {unit} of {_gb(d.capacity)} {unit}" for d in bad)
        )
    for r in plan.recommendations:
        lines.append(f"  - {r}")
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines) + "\n"


def _throughput_lines(plan: Plan) -> list[str]:
    tp = plan.throughput
    now, best = tp["as_launched"], tp["best_split"]
    out = [
        f"throughput model ({tp['gpu']}: {tp['peak_flops'] / 1e12:.0f} TFLOP/s bf16 peak x {tp['utilization']:.0%} "
        f"utilization, {tp['link']} {tp['link_bytes_per_s'] / 1e9:.0f} GB/s into each drafter GPU):",
        f"  per row: target forward {now['target_s_per_row']:.2f} s on one target GPU, drafter step "
        f"{now['drafter_s_per_row']:.2f} s, transfer {now['bytes_per_row'] / 1e9:.2f} GB in "
        f"{now['link_s_per_row']:.3f} s",
        f"  as launched ({now['target_ranks']} + {now['drafter_ranks']}): {now['tokens_per_s']:,.0f} tokens/s, "
        f"bottleneck: {now['bottleneck']}",
        f"  best split of {now['target_ranks'] + now['drafter_ranks']} GPUs: {best['target_ranks']} target + "
        f"{best['drafter_ranks']} drafter, {best['tokens_per_s']:,.0f} tokens/s (bottleneck: {best['bottleneck']})",
    ]
    v = tp.get("vllm_capture")
    if v:
        out.append(
            f"  with vLLM capturing (docs/large-targets.md; ideal tensor-parallel scaling, an upper bound): one server "
            f"of {v['gpus_per_server']} GPUs {v['server_tokens_per_s']:,.0f} tokens/s, one drafter GPU training from "
            f"the cache {v['drafter_tokens_per_s']:,.0f} tokens/s: {v['servers_per_drafter_gpu']:.1f} servers keep "
            "one drafter GPU busy (fewer: capture bounds tokens/s)"
        )
    return out


def render_json(plan: Plan) -> dict:
    s = plan.target
    return {
        "target": {
            "name": s.name,
            "model_type": s.model_type,
            "layers": s.num_layers,
            "hidden_size": s.hidden_size,
            "vocab_size": s.vocab_size,
            "parameters": target_param_count(s),
        },
        "workload": asdict(plan.workload),
        "topology": asdict(plan.topology),
        "naive": plan.naive,
        "loss_chunk": plan.chunk,
        "loss_chunk_source": plan.chunk_source,
        "fits": plan.fits,
        "throughput": plan.throughput,
        "data": plan.data,
        "capture": plan.capture,
        "devices": [
            {
                "role": d.role,
                "count": d.count,
                "capacity_bytes": d.capacity,
                "peak_phase": d.peak_phase,
                "phase_bytes": d.phases,
                "tensor_peak_bytes": d.peak,
                "runtime_bytes": d.runtime,
                "margin_bytes": d.margin,
                "total_bytes": d.total,
                "fits": d.fits,
                "items": [
                    {"name": i.name, "bytes": i.bytes, "at_peak": i.name in d.in_peak, "note": i.note} for i in d.items
                ],
            }
            for d in plan.devices
        ],
        "recommendations": plan.recommendations,
        "notes": plan.notes,
    }
