"""Acceptance of several drafter checkpoints of one target on the same rows (``dflash-train eval``).

One target model serves every checkpoint: each is wrapped with its own hooked layer ids, its drafter
loaded, scored teacher-forced (``acceptance.acceptance_report``: chain, per slot, DDTree per budget)
and, at ``temperature > 0``, under speculative sampling (``sampled_acceptance.sampled_report``), then
dropped before the next one is loaded, so one drafter at a time is in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, TypedDict

from ..model.drafter import DFlashDrafter
from ..model.target import TargetModel
from .acceptance import acceptance_report
from .sampled_acceptance import sampled_report


class Checkpoint(NamedTuple):
    """A drafter to evaluate: its path, the label the report and plots show, and its metadata
    (``drafter_meta``: ``target.layer_ids``, optionally ``step``)."""

    path: Path
    label: str
    meta: dict


class CheckpointEntry(TypedDict):
    """One checkpoint's part of ``dflash-train eval``'s report.json."""

    label: str
    path: str
    step: int | None
    layer_ids: list[int]
    report: dict  # acceptance_report's dict, plus "sampling" (sampled_report) at temperature > 0


def evaluate_checkpoints(
    model,
    checkpoints: Sequence[Checkpoint],
    rows: Sequence,
    load_drafter: Callable[[Path, TargetModel], DFlashDrafter],
    *,
    budgets: Sequence[int],
    max_blocks_per_row: int = 64,
    seed: int = 1234,
    attention_backend: str = "dense",
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    sample_prompts: int = 8,
    max_new_tokens: int = 128,
    log: Callable[[str], None] = lambda line: None,
) -> list[CheckpointEntry]:
    """Every checkpoint's acceptance against ``model`` (the Hugging Face target, on its device) on the
    packed ``rows`` (``PackedRow``, ``[L]`` tensors), in ``checkpoints`` order.

    ``load_drafter(path, target)`` returns the checkpoint's drafter for ``target`` (a ``TargetModel``
    hooking the checkpoint's layer ids); it is moved to ``model``'s device. Anchors are drawn with
    ``seed``, up to ``max_blocks_per_row`` per row, the same for every checkpoint. At ``temperature > 0``
    the report also holds ``sampling``: tau(T) expected and measured from the first ``sample_prompts``
    documents' prompts, ``max_new_tokens`` each, stopping at ``eos_ids``. ``log`` gets one line per
    checkpoint (and one more when sampling) as each result is known.
    """
    entries: list[CheckpointEntry] = []
    for path, label, meta in checkpoints:
        target = TargetModel(model, layer_ids=meta["target"]["layer_ids"])
        drafter = load_drafter(path, target)
        drafter.to(model.device)
        report = acceptance_report(
            target,
            drafter,
            rows,
            budgets=budgets,
            max_blocks_per_row=max_blocks_per_row,
            seed=seed,
            attention_backend=attention_backend,
        )
        log(f"{label}: chain tau {report['tau']:.3f} over {report['blocks']} blocks")
        if temperature > 0:
            report["sampling"] = sampled_report(
                target,
                drafter,
                rows,
                list(eos_ids),
                temperature=temperature,
                top_p=top_p,
                budgets=budgets,
                prompts=sample_prompts,
                max_new_tokens=max_new_tokens,
                max_blocks_per_row=max_blocks_per_row,
                seed=seed,
                attention_backend=attention_backend,
            )
            ex, me = report["sampling"]["expected"], report["sampling"]["measured"]
            log(
                f"{label}: T={temperature:g} chain tau expected {ex['tau']:.3f}, measured "
                f"{me['chain']['tau']:.3f} +- {me['chain']['stderr']:.3f} ({me['chain']['rounds']} rounds)"
            )
        entries.append(
            CheckpointEntry(
                label=label, path=str(path), step=meta.get("step"), layer_ids=target.layer_ids, report=report
            )
        )
        del drafter  # before the next checkpoint's drafter is loaded: one in memory at a time
    return entries
