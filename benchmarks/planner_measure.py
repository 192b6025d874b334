"""Measure the peak memory of a real CPU training step or target forward, to validate the planner.

The measurement is the CPU allocator's own record: ``torch.profiler`` with ``profile_memory=True``
logs every allocation and free that goes through c10's CPU allocator, including the temporaries that
ATen kernels make internally (``logsumexp``'s exp, SDPA's mask conversion), which a tensor-level
tracker such as ``MemTracker`` does not see. The running sum of those events gives the peak above
the start of the measured call; the bytes of every tensor alive at the start (found through the
garbage collector) are added to it. RSS is not used: it follows glibc's arenas, not tensors.

Each case runs in a fresh process (``python benchmarks/planner_measure.py CASE_JSON``) so that one
case's allocations cannot hide in another's. The phases are the ``record_function`` ranges that
``training/step.py`` and ``Trainer.train_step`` mark (``PHASE_PREFIX + name``).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash_trainer.training.step import PHASE_PREFIX  # train_step marks its phases with it


@dataclass(frozen=True)
class Case:
    """A synthetic Qwen3 target plus a run config (dotted overrides on the schema defaults)."""

    name: str
    kind: str  # "step": one Trainer.train_step (target + drafter on the CPU); "target": TargetModel.features
    hidden: int = 128
    intermediate: int = 384
    vocab: int = 4096
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    docs: int = 3  # documents per packed row (several: the target's packed-row attention mask is built)
    constant_tokens: bool = False  # a row of one repeated token: after warm-up steps every CAP row is correct
    warmup_steps: int = 1
    hybrid: bool = False  # a Qwen3.5-style target: Gated DeltaNet layers (3 of 4) run one document at a time
    overrides: tuple[str, ...] = field(default_factory=tuple)

    def config_json(self) -> dict:
        out = {
            "model_type": "qwen3_5_text" if self.hybrid else "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": False,
        }
        if self.hybrid:
            out.update(
                linear_num_key_heads=self.kv_heads,
                linear_num_value_heads=self.heads,
                linear_key_head_dim=self.head_dim,
                linear_value_head_dim=self.head_dim,
                linear_conv_kernel_dim=4,
            )
        return out


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of every tensor the garbage collector can reach."""
    import torch

    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                    st = obj.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return total


THREADS = 2  # intra-op threads of every measured case (the CPU attention kernel's workspace is per thread)


def allocator_peak(fn, device: str = "cpu") -> tuple[object, int, dict[str, int]]:
    """``(fn(), peak bytes allocated above the start, {phase: peak})`` from the allocator events of
    ``torch.profiler`` on ``device`` ("cpu" or "cuda": CUDA's caching allocator reports its blocks the
    same way); phases are ``record_function`` ranges named ``PHASE_PREFIX + name``."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        out = fn()
    events, ranges, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            if str(e.extra_fields.device).split(":")[0] == device:
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
        elif e.tag == _EventType.TorchOp and e.name.startswith(PHASE_PREFIX):  # not the GPU-side copy of the range
            ranges.append((e.name[len(PHASE_PREFIX) :], e.start_time_ns, e.end_time_ns))
        stack.extend(e.children)
    events.sort()
    cur = peak = 0
    phases: dict[str, int] = {}
    for when, n in events:
        cur += n
        peak = max(peak, cur)
        for name, start, end in ranges:
            if start <= when <= end:
                phases[name] = max(phases.get(name, cur), cur)
    return out, peak, phases


def _build(case: Case):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from dflash_trainer.config import load_config
    from dflash_trainer.data.packing import PackedRow
    from dflash_trainer.model.target import TargetModel

    cfg = load_config([], ["drafter.mask_token_id=3", "train.lr=1e-2", *case.overrides])
    torch.manual_seed(0)
    c = case.config_json()
    kwargs = {k: v for k, v in c.items() if k != "model_type"}
    tc = Qwen3_5TextConfig(**kwargs) if case.hybrid else Qwen3Config(**kwargs)
    model = AutoModelForCausalLM.from_config(tc).to(getattr(torch, cfg.target.dtype)).eval()
    target = TargetModel(model, layer_ids=cfg.target.layer_ids, num_feature_layers=cfg.target.num_feature_layers)
    length = cfg.data.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.full((length,), 5) if case.constant_tokens else torch.randint(4, case.vocab, (length,), generator=g)
    sizes = [length // case.docs] * (case.docs - 1)
    sizes.append(length - sum(sizes))
    positions = torch.cat([torch.arange(n) for n in sizes])
    row = PackedRow(ids, positions, torch.ones(length, dtype=torch.long))
    return cfg, target, row


def run_case(case: Case) -> dict:
    """Measure one case in this process. Returns bytes: ``start`` (live tensors before the measured call),
    ``peak`` (start + allocator peak above it), plus what the prediction needs (``accuracy``)."""
    import torch

    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore")
    cfg, target, row = _build(case)
    result: dict = {"case": case.name}
    if case.kind == "target":
        need = cfg.loss.kl_weight > 0 or cfg.loss.labels == "teacher"
        start = live_tensor_bytes()
        _, extra, phases = allocator_peak(lambda: target.features(row.input_ids, row.position_ids, need_teacher=need))
    else:
        from dflash_trainer.training.trainer import Trainer

        trainer = Trainer(
            cfg,
            target,
            None,
            [row],
            [],
            out_dir=tempfile.mkdtemp(prefix="dflash-measure-"),
            target_path=None,
            progress=False,
        )
        for _ in range(case.warmup_steps):  # AdamW's states exist from the first step on
            trainer.train_step()
        trainer.zero_grad()
        start = live_tensor_bytes()
        out, extra, phases = allocator_peak(trainer.train_step)
        result["accuracy"] = out["accuracy"] if out else None
    result.update(start=start, peak=start + extra, extra=extra, phases={k: start + v for k, v in phases.items()})
    return result


def measure_in_subprocess(case: Case, timeout: int = 600) -> dict:
    """``run_case`` in a fresh Python process (clean allocator, nothing left over from other cases)."""
    payload = json.dumps({**case.__dict__, "overrides": list(case.overrides)})
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), payload], capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
        raise RuntimeError(f"measuring {case.name} failed: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def predict_case(case: Case, accuracy: float | None = None) -> dict:
    """The planner's prediction for a case, on this CPU (target and drafter share the device)."""
    from dflash_trainer.config import load_config
    from dflash_trainer.planner.plan import Topology, drafter_device_plan, drafter_phases, target_phases
    from dflash_trainer.planner.report import workload_from_config
    from dflash_trainer.planner.shapes import TargetShape

    cfg = load_config([], ["drafter.mask_token_id=3", *case.overrides])
    shape = TargetShape.from_config(case.config_json(), case.name)
    w = replace(workload_from_config(cfg), packed=case.docs > 1)
    from dflash_trainer.planner.plan import _target_layer_ids

    ids = _target_layer_ids(shape, w, cfg.target.layer_ids)
    topo = Topology(memory=1 << 62, device_name="cpu", device="cpu", allocator_margin=0.0, cpu_threads=THREADS)
    if case.kind == "target":
        items = target_phases(shape, w, ids, naive=False, cpu_threads=THREADS)
        return {"peak": sum(items.values()), "start": items["target weights"], "items": items}
    chunk = cfg.loss.chunk_size
    if chunk is None:
        from dflash_trainer.loss.chunks import chunk_rows

        chunk = chunk_rows(shape.vocab_size, None, None)  # what draft_loss does without a chunk size
    correct = 1.0 if accuracy is None else accuracy
    dev = drafter_device_plan(shape, w, topo, ids, chunk, correct_fraction=correct)
    opt = drafter_phases(shape, w, topo, ids, chunk, correct_fraction=correct)["optimizer"]
    start = sum(v for k, v in opt.items() if k not in ("gradients (fp32)", "temporaries (largest step)"))
    return {
        "peak": dev.peak,
        "peak_phase": dev.peak_phase,
        "phases": dev.phases,
        "start": start,
        "items": {i.name: i.bytes for i in dev.items},
    }


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    spec["overrides"] = tuple(spec.get("overrides", ()))
    print(json.dumps(run_case(Case(**spec))))
