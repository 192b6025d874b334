"""Teacher-forced acceptance of drafter checkpoints: chain and DDTree, as JSON and plots (``dflash-train eval``).

For greedy decoding a block's drafts do not depend on anything inside the block, so acceptance can
be measured on held-out packed rows in one pass, without running the decoding loop
(shared/DESIGN.md section 2). Per block of size B anchored at position a:

    greedy_k = argmax W h_target[a + k - 1]           the target's greedy token for slot k (k = 1..B-1)
    draft_k  = argmax W h_drafter[slot k]             the drafter's chain proposal
    chain:   accepted = longest prefix with draft_k == greedy_k            (0..B-1)
    DDTree:  accepted = depth of the greedy path inside build_tree(log_softmax(W h_drafter[1..B-1]), budget)
    tau = mean(accepted + 1)                          (+1: the target's bonus token)

``W`` is the target's frozen ``lm_head`` ``[V, H]``; only the selected rows are projected, a few
blocks at a time, so no ``[L x V]`` (nor ``[blocks x B x V]`` for a big vocabulary) tensor exists.
Blocks are sampled exactly like ``train.teacher_forced_acceptance`` (same seed, same order), whose
chain tau this module reproduces.

``dflash-train eval CKPT [CKPT ...] --data FILE_OR_DIR --out DIR`` evaluates several checkpoints of
one target on the same rows and writes ``DIR/report.json``, ``DIR/acceptance_per_slot.png``,
``DIR/tau_vs_budget.png``, ``DIR/data_report.json`` and ``DIR/run.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from numbers import Integral
from pathlib import Path
from types import SimpleNamespace

import torch

from .anchors import build_blocks, doc_ids_from_positions, sample_anchors, valid_anchor_positions
from .config.cli_args import add_config_args, resolve_config
from .ddtree import accepted_in_tree, build_tree
from .drafter import DFlashDrafter
from .errors import UserError
from .loss import head_logit_options
from .loss.reference import transform_logits

DEFAULT_BUDGETS = (16, 32, 64, 128, 256, 512)
REPORT_FORMAT = "dflash-trainer-eval/1"
# Logit elements one projection chunk may hold: 2**24 fp32 = 64 MiB. A 248K vocabulary with B = 16
# gives 4 blocks per chunk; the 8K-token tiny target does a row's blocks at once.
MAX_LOGIT_ELEMENTS = 1 << 24


class EvalInputError(UserError, ValueError):
    """A bad evaluation input (budget, block count, data, checkpoint), explained in one line."""


def check_budgets(budgets: Sequence[int]) -> list[int]:
    """Sorted distinct DDTree budgets; each must be an integer >= 1."""
    if not budgets:
        raise EvalInputError("no DDTree budget given")
    bad = [b for b in budgets if isinstance(b, bool) or not isinstance(b, Integral) or b < 1]
    if bad:
        raise EvalInputError(f"DDTree budgets must be integers >= 1, got {bad[0]!r}")
    return sorted({int(b) for b in budgets})


@torch.no_grad()
def acceptance_report(target, drafter: DFlashDrafter, rows: Sequence, *, budgets: Sequence[int] = DEFAULT_BUDGETS,
                      max_blocks_per_row: int = 64, seed: int = 1234, attention_backend: str = "dense",
                      max_logit_elements: int = MAX_LOGIT_ELEMENTS) -> dict:
    """Chain and DDTree acceptance of ``drafter`` against ``target``'s greedy tokens on packed ``rows``.

    ``target`` is a ``TargetModel``; each row is a ``PackedRow`` (``[L]`` tensors, on the CPU or the
    target's device). Up to ``max_blocks_per_row`` anchors per row are drawn with a generator seeded
    by ``seed``. Returns (B = block size, N = blocks evaluated):

        tau                     chain tau, mean(accepted + 1)
        slot_acceptance         [B-1]  P(draft_k == greedy_k), slots 1..B-1
        conditional_acceptance  [B-1]  P(draft_k == greedy_k | slots 1..k-1 accepted); None where no
                                       block got that far
        reach                   [B-1]  P(accepted >= k); sums to tau - 1
        accepted_histogram      [B]    blocks with 0..B-1 accepted drafts; sums to N
        budgets, ddtree_tau     DDTree tau per budget (same order)
        blocks, rows, rows_without_blocks, block_size
    """
    budgets = check_budgets(budgets)
    if isinstance(max_blocks_per_row, bool) or not isinstance(max_blocks_per_row, int) or max_blocks_per_row < 1:
        raise EvalInputError(f"max blocks per row must be an integer >= 1, got {max_blocks_per_row!r}")
    if not rows:
        raise EvalInputError("no evaluation rows: the data set is empty")
    b = drafter.spec.block_size
    head = target.lm_head_weight  # [V, H]
    dev, vocab = head.device, head.shape[0]
    logit_options = head_logit_options(target.config)
    per_chunk = max(1, max_logit_elements // ((b - 1) * vocab))
    gen = torch.Generator().manual_seed(seed)
    accepted_parts, match_parts, tree_parts = [], [], []
    rows_used = rows_empty = 0
    was_training = drafter.training
    drafter.eval()
    try:
        for row in rows:
            # Anchors and blocks are index bookkeeping: done on the CPU, exactly as in training's eval,
            # so the same seed draws the same anchors.
            ids, pos, loss_mask = row.input_ids.cpu(), row.position_ids.cpu(), row.loss_mask.cpu()
            doc = doc_ids_from_positions(pos)
            anchors = sample_anchors(loss_mask, doc, b, max_blocks_per_row, gen)
            n = anchors.numel()
            if n == 0:
                rows_empty += 1
                continue
            rows_used += 1
            feats = target.features(ids.to(dev), pos.to(dev), need_teacher=True)  # [L, k*H], [L, H]
            blocks = build_blocks(ids, pos, loss_mask, anchors, block_size=b, mask_token_id=drafter.spec.mask_token_id,
                                  gamma=1.0)  # gamma only weights the loss; acceptance ignores it
            masks = drafter.build_masks(blocks.anchors.to(dev), blocks.doc_ids.to(dev), doc.to(dev), attention_backend)
            hidden = drafter(blocks.input_ids.to(dev), blocks.position_ids.to(dev), feats.context, pos.to(dev), masks,
                             attention_backend).view(n, b, -1)  # [n, B, H]
            teacher_index = blocks.teacher_index[:, 1:].to(dev)  # [n, B-1]: anchor + k - 1
            for start in range(0, n, per_chunk):
                stop = min(n, start + per_chunk)
                draft_logits = hidden[start:stop, 1:].to(head.dtype) @ head.T  # [g, B-1, V]
                greedy = (feats.last_hidden[teacher_index[start:stop]] @ head.T).argmax(-1)  # [g, B-1]
                match = draft_logits.argmax(-1) == greedy  # [g, B-1]
                accepted_parts.append(match.long().cumprod(1).sum(1).cpu())
                match_parts.append(match.cpu())
                log_probs = torch.log_softmax(transform_logits(draft_logits.float(), **logit_options), dim=-1)
                greedy_lists = greedy.tolist()
                for j, path in enumerate(greedy_lists):
                    tree_parts.append([accepted_in_tree(build_tree(log_probs[j], budget), path) for budget in budgets])
                del draft_logits, log_probs
    finally:
        drafter.train(was_training)
    if not accepted_parts:
        raise EvalInputError(f"no valid block of {b} tokens in {len(rows)} evaluation rows (an anchor needs "
                             f"loss_mask 1 and {b - 1} more tokens of the same document)")
    accepted = torch.cat(accepted_parts)  # [N]
    match = torch.cat(match_parts).double()  # [N, B-1]
    tree_accepted = torch.tensor(tree_parts, dtype=torch.float64)  # [N, budgets]
    total = accepted.numel()
    reach_counts = [(accepted >= k).sum().item() for k in range(b)]  # reach_counts[0] == N
    conditional = [reach_counts[k] / reach_counts[k - 1] if reach_counts[k - 1] else None for k in range(1, b)]
    decode = decode_path_acceptance(target, drafter, rows, attention_backend=attention_backend)
    return {
        "decode_tau": decode["tau"], "decode_rounds": decode["rounds"],
        "block_size": b, "blocks": total, "rows": rows_used, "rows_without_blocks": rows_empty,
        "tau": (accepted.double() + 1).mean().item(),
        "slot_acceptance": match.mean(0).tolist(),
        "conditional_acceptance": conditional,
        "reach": [c / total for c in reach_counts[1:]],
        "accepted_histogram": torch.bincount(accepted, minlength=b).tolist(),
        "budgets": budgets,
        "ddtree_tau": (tree_accepted + 1).mean(0).tolist(),
    }


@torch.no_grad()
def decode_path_acceptance(target, drafter: DFlashDrafter, rows: Sequence, *, attention_backend: str = "dense",
                           max_blocks: int = 256) -> dict:
    """Tau along the path greedy speculative decoding takes through each document's response.

    The sampled-anchor ``tau`` weights every position alike; decoding visits an anchor, accepts ``a``
    drafts and jumps to ``anchor + a + 1``, so it spends more rounds where drafts fail. Here every
    valid anchor's teacher-forced acceptance is computed in the training layout, then each document
    is walked from its first loss position the way ``generate --speculative chain`` walks it:
    ``tau = mean(a + 1)`` over the visited anchors. On the target's own greedy responses this is the
    tau that speculative decoding measures (tested against it).
    """
    b = drafter.spec.block_size
    head = target.lm_head_weight
    dev = head.device
    was_training = drafter.training
    drafter.eval()
    visited = []
    try:
        for row in rows:
            ids, pos, loss_mask = row.input_ids.cpu(), row.position_ids.cpu(), row.loss_mask.cpu()
            doc = doc_ids_from_positions(pos)
            anchors = valid_anchor_positions(loss_mask, doc, b)
            if anchors.numel() == 0:
                continue
            feats = target.features(ids.to(dev), pos.to(dev), need_teacher=True)
            accepted = {}
            for start in range(0, anchors.numel(), max_blocks):
                part = anchors[start:start + max_blocks]
                blocks = build_blocks(ids, pos, loss_mask, part, block_size=b, mask_token_id=drafter.spec.mask_token_id,
                                      gamma=1.0)
                masks = drafter.build_masks(blocks.anchors.to(dev), blocks.doc_ids.to(dev), doc.to(dev), attention_backend)
                hidden = drafter(blocks.input_ids.to(dev), blocks.position_ids.to(dev), feats.context, pos.to(dev),
                                 masks, attention_backend).view(part.numel(), b, -1)
                draft = (hidden[:, 1:].to(head.dtype) @ head.T).argmax(-1)
                greedy = (feats.last_hidden[blocks.teacher_index[:, 1:].to(dev)] @ head.T).argmax(-1)
                counts = (draft == greedy).long().cumprod(1).sum(1).tolist()
                accepted.update(zip(part.tolist(), counts))
            for d in doc[anchors].unique().tolist():  # walk each document from its first valid anchor
                p = int(anchors[doc[anchors] == d][0])
                while p in accepted:
                    visited.append(accepted[p])
                    p += accepted[p] + 1
    finally:
        drafter.train(was_training)
    if not visited:
        return {"tau": None, "rounds": 0}
    return {"tau": sum(a + 1 for a in visited) / len(visited), "rounds": len(visited)}


# -- output ----------------------------------------------------------------------------------------


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` into a temporary file next to ``path``, then rename: never half a file.
    (Not ``mkstemp``: its files are private, 0600, and a report is meant to be shared.)"""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unique_labels(paths: Sequence[Path]) -> list[str]:
    """Shortest trailing path parts that tell the checkpoints apart (``run-a/step-0000800``)."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]  # as typed: symlinks are names too
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # the same folder twice: keep what the user typed


def plot_acceptance(entries: list[dict], path: Path) -> None:
    """Acceptance per slot, unconditional (left) and conditional on the slots before (right)."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no pyplot, no GUI backend

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True)
    for e in entries:
        r = e["report"]
        slots = list(range(1, r["block_size"]))
        left.plot(slots, r["slot_acceptance"], marker="o", label=e["label"])
        right.plot(slots, [float("nan") if c is None else c for c in r["conditional_acceptance"]], marker="o")
    left.set_title("P(draft = target greedy) per slot")
    right.set_title("same, given all earlier slots accepted")
    for ax in (left, right):
        ax.set_xlabel("slot k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    left.set_ylabel("acceptance")
    fig.legend(*left.get_legend_handles_labels(), loc="outside lower center", ncols=min(3, len(entries)), fontsize=8)
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def plot_tau_vs_budget(entries: list[dict], path: Path) -> None:
    """DDTree tau against the tree budget (log2 axis); each checkpoint's chain tau as a dashed line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, e in enumerate(entries):
        r = e["report"]
        color = f"C{i % 10}"
        ax.plot(r["budgets"], r["ddtree_tau"], marker="o", color=color, label=f"{e['label']} DDTree")
        ax.axhline(r["tau"], color=color, linestyle="--", linewidth=1, label=f"{e['label']} chain")
    budgets = sorted({bud for e in entries for bud in e["report"]["budgets"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(bud) for bud in budgets])
    ax.set_xlabel("DDTree budget (nodes)")
    ax.set_ylabel("tau (tokens per target pass)")
    ax.set_title("Acceptance length: DDTree vs chain")
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def format_table(entries: list[dict]) -> str:
    """One line per checkpoint: blocks, chain tau (sampled anchors), decode-path tau, DDTree tau per budget."""
    budgets = entries[0]["report"]["budgets"]
    width = max(10, *(len(e["label"]) for e in entries))
    head = (f"{'checkpoint':<{width}}  {'blocks':>6}  {'chain':>6}  {'decode':>6}  "
            + "  ".join(f"{'T@' + str(b):>6}" for b in budgets))
    lines = [head]
    for e in entries:
        r = e["report"]
        decode = f"{r['decode_tau']:>6.3f}" if r.get("decode_tau") is not None else f"{'-':>6}"
        lines.append(f"{e['label']:<{width}}  {r['blocks']:>6}  {r['tau']:>6.3f}  {decode}  "
                     + "  ".join(f"{t:>6.3f}" for t in r["ddtree_tau"]))
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------


def _parse_positive_ints(text: str, what: str) -> list[int]:
    """``"16,32"`` -> ``[16, 32]``; a one-line error for anything but integers >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise EvalInputError(f"{what} must be comma-separated integers >= 1, got {text!r}") from None
    if not values or min(values) < 1:
        raise EvalInputError(f"{what} must be integers >= 1, got {text!r}")
    return values


def _parse_positive_int(text: str, what: str) -> int:
    values = _parse_positive_ints(text, what)
    if len(values) != 1:
        raise EvalInputError(f"{what} takes one integer >= 1, got {text!r}")
    return values[0]


def _set_keys(overrides: list[str]) -> set[str]:
    return {o.split("=", 1)[0].strip() for o in overrides}


def _read_metas(checkpoints: list[Path]) -> list[dict]:
    from .checkpoint import read_checkpoint_config

    metas = []
    for path in checkpoints:
        try:
            metas.append(read_checkpoint_config(path))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EvalInputError(f"checkpoint {path}: drafter_config.json is not valid JSON ({exc})") from None
    return metas


def _target_path(metas: list[dict], cfg, overrides: list[str]) -> str:
    """The one target every checkpoint is evaluated on: ``--set target.path`` wins over the path the
    checkpoints recorded; checkpoints of different targets are not comparable, so that is an error."""
    if "target.path" in {o.split("=", 1)[0].strip() for o in overrides}:
        return cfg.target.path
    recorded = {m["target"].get("path") or cfg.target.path for m in metas}
    if len(recorded) > 1:
        raise EvalInputError(f"the checkpoints were trained for different targets ({', '.join(sorted(recorded))}); "
                             "evaluate them separately or pick one with --set target.path=...")
    return recorded.pop()


def _check_checkpoint(path: Path, meta: dict, shape, cfg):
    """The checkpoint's ``DrafterSpec`` after checking it against the target's shape (``hidden_size``,
    ``vocab_size``, ``num_layers``): done from the target's config, before its weights are loaded."""
    from .checkpoint import check_against_target
    from .drafter import DrafterSpec

    ids = list(meta["target"]["layer_ids"])
    if cfg.target.layer_ids is not None and list(cfg.target.layer_ids) != ids:
        raise EvalInputError(f"checkpoint {path} was trained on target layer ids {ids}, the config asks for "
                             f"{list(cfg.target.layer_ids)}")
    spec = DrafterSpec(**{**meta["spec"], "sliding_window_layers": tuple(meta["spec"]["sliding_window_layers"])})
    # The target hooks the checkpoint's own layer ids, so check_against_target's id comparison is
    # about range and count here; the layer count below catches a checkpoint of a deeper or shallower model.
    check_against_target(spec, ids, SimpleNamespace(**vars(shape), layer_ids=ids), f"checkpoint {path}")
    trained_layers = meta["target"].get("num_layers")
    if trained_layers is not None and trained_layers != shape.num_layers:
        raise EvalInputError(f"checkpoint {path} does not match the target: trained on a {trained_layers}-layer "
                             f"target, this one has {shape.num_layers} layers")
    return spec


def _target_shape_and_tokenizer(target_path: str):
    """``(shape, tokenizer)`` of a target folder without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from .target_loading import TargetLoadError, resolve_target_path

    folder = resolve_target_path(target_path)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"cannot load target from {folder}: {first}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = SimpleNamespace(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                            num_layers=text.num_hidden_layers)
    return shape, tokenizer


def run_eval(args: argparse.Namespace) -> int:
    """``dflash-train eval``: evaluate every checkpoint on the same rows, write the report and plots.

    Every input is checked (arguments, checkpoints against the target's config, data) before the
    target's weights are loaded: a bad input fails in seconds, even for a 54 GB target."""
    from .checkpoint import load_drafter
    from .config import write_resolved_config
    from .data.documents import load_documents
    from .data.packing import pack_documents
    from .target import TargetModel
    from .target_loading import load_target

    budgets = check_budgets(_parse_positive_ints(args.budgets, "--budgets"))
    max_blocks = _parse_positive_int(args.max_blocks_per_row, "--max-blocks-per-row")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise EvalInputError(f"--out {out} exists and is not a folder")
    cfg = resolve_config(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoints = [Path(c) for c in args.checkpoints]
    metas = _read_metas(checkpoints)
    target_path = _target_path(metas, cfg, args.overrides)
    shape, tokenizer = _target_shape_and_tokenizer(target_path)
    specs = [_check_checkpoint(path, meta, shape, cfg) for path, meta in zip(checkpoints, metas)]

    # One row set for all checkpoints, so they are compared on the same text; every document must
    # hold a block of the largest block size.
    out.mkdir(parents=True, exist_ok=True)
    docs, data_report = load_documents(args.data, tokenizer, vocab_size=shape.vocab_size,
                                       min_tokens=max(s.block_size for s in specs),
                                       max_bad_fraction=cfg.data.max_bad_fraction, report_path=out / "data_report.json")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = pack_documents(docs, cfg.data.seq_len, pad)

    model, _, _ = load_target(cfg.target.model_copy(update={"path": target_path}))
    model.to(device)
    print(f"data: {data_report.n_documents} documents ({data_report.n_tokens:,} tokens), {data_report.n_bad} bad "
          f"records skipped; {len(rows)} rows of {cfg.data.seq_len} tokens; target {target_path} on {device}",
          flush=True)
    entries = []
    for path, label, meta in zip(checkpoints, unique_labels(checkpoints), metas):
        target = TargetModel(model, layer_ids=meta["target"]["layer_ids"])
        drafter, _ = load_drafter(path, target)  # checks again, against the loaded weights' shapes
        drafter.to(device)
        report = acceptance_report(target, drafter, rows, budgets=budgets, max_blocks_per_row=max_blocks,
                                   seed=args.seed, attention_backend=cfg.drafter.attention_backend)
        print(f"{label}: chain tau {report['tau']:.3f} over {report['blocks']} blocks", flush=True)
        entries.append({"label": label, "path": str(path), "step": meta.get("step"), "layer_ids": target.layer_ids,
                        "report": report})
        del drafter

    result = {"format": REPORT_FORMAT, "target": target_path, "data": list(args.data), "seq_len": cfg.data.seq_len,
              "rows": len(rows), "max_blocks_per_row": max_blocks, "seed": args.seed, "budgets": budgets,
              "checkpoints": entries}
    _atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(result, indent=2) + "\n"))
    plot_acceptance(entries, out / "acceptance_per_slot.png")
    plot_tau_vs_budget(entries, out / "tau_vs_budget.png")
    write_resolved_config(cfg, out)
    print(format_table(entries))
    print(f"wrote {out / 'report.json'}, {out / 'acceptance_per_slot.png'}, {out / 'tau_vs_budget.png'}")
    return 0


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on the main CLI's sub-parsers; its ``func`` is ``run_eval``."""
    p = subparsers.add_parser(
        "eval", help="teacher-forced chain and DDTree acceptance of drafter checkpoints, with plots",
        description="Measure how many drafted tokens the target would accept (chain tau, acceptance per "
        "slot, DDTree tau per budget) on held-out data, for one or more checkpoints of the same target. "
        "Writes DIR/report.json, DIR/acceptance_per_slot.png and DIR/tau_vs_budget.png.",
    )
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="drafter checkpoint folder(s)")
    p.add_argument("--data", action="append", required=True, metavar="FILE_OR_DIR",
                   help="held-out JSONL (chat or pre-tokenized records), or a folder of *.jsonl; repeatable")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)), metavar="N,N,...",
                   help=f"DDTree budgets (default {','.join(map(str, DEFAULT_BUDGETS))})")
    p.add_argument("--max-blocks-per-row", default="64", metavar="N", help="blocks sampled per packed row (default 64)")
    p.add_argument("--seed", type=int, default=1234, help="anchor sampling seed (default 1234)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add_config_args(p, default_preset="tiny-demo",
                    set_help="dotted override, e.g. --set target.path=/models/qwen (default: the checkpoint's target)")
    p.set_defaults(func=run_eval)
    return p
