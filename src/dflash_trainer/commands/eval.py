"""``dflash-train eval CKPT [CKPT ...] --data FILE_OR_DIR --out DIR``: acceptance of drafter checkpoints.

Evaluates several checkpoints of one target on the same rows (``inference.checkpoint_eval``) and writes
``DIR/report.json``, ``DIR/acceptance_per_slot.png``, ``DIR/tau_vs_budget.png``,
``DIR/data_report.json`` and ``DIR/run.yaml``. With ``--temperature T > 0`` each checkpoint's report
also holds ``sampling``: tau(T) expected under target sampling along the held-out responses and
measured by real speculative sampling from the documents' prompts (``inference.sampled_acceptance``),
chain and per DDTree budget, also drawn in ``tau_vs_budget.png``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config.cli_args import add_config_args, resolve_config
from ..inference.acceptance import DEFAULT_BUDGETS, REPORT_FORMAT, EvalInputError, check_budgets
from ..io import atomic_write, atomic_write_json


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
        slots = list(range(1, len(r["slot_acceptance"]) + 1))  # D draft slots (DSpark's sample_from_anchor: B)
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
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def plot_tau_vs_budget(entries: list[dict], path: Path) -> None:
    """DDTree tau against the tree budget (log2 axis); each checkpoint's chain tau as a horizontal line.
    Greedy: solid (DDTree) and dashed (chain); with a ``sampling`` report, tau(T) expected (dotted,
    squares) and measured (dash-dot, crosses with standard errors)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, e in enumerate(entries):
        r = e["report"]
        color = f"C{i % 10}"
        ax.plot(r["budgets"], r["ddtree_tau"], marker="o", color=color, label=f"{e['label']} DDTree")
        ax.axhline(r["tau"], color=color, linestyle="--", linewidth=1, label=f"{e['label']} chain")
        sampled = r.get("sampling")
        if sampled:
            t, ex, me = sampled["temperature"], sampled["expected"], sampled["measured"]
            name = f"{e['label']} T={t:g}"
            ax.plot(ex["budgets"], ex["ddtree_tau"], ":s", color=color, label=f"{name} DDTree expected")
            ax.axhline(ex["tau"], color=color, linestyle=":", linewidth=1, label=f"{name} chain expected")
            if me["ddtree"]:
                ax.errorbar(
                    me["budgets"],
                    [m["tau"] for m in me["ddtree"]],
                    yerr=[m["stderr"] or 0 for m in me["ddtree"]],
                    fmt="-.x",
                    color=color,
                    label=f"{name} DDTree measured",
                )
            if me["chain"]["tau"] is not None:
                ax.axhline(me["chain"]["tau"], color=color, linestyle="-.", linewidth=1, label=f"{name} chain measured")
    budgets = sorted({bud for e in entries for bud in e["report"]["budgets"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(bud) for bud in budgets])
    ax.set_xlabel("DDTree budget (nodes)")
    ax.set_ylabel("tau (tokens per target pass)")
    ax.set_title("Acceptance length: DDTree vs chain (greedy; sampled where given)")
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def format_table(entries: list[dict]) -> str:
    """One line per checkpoint: blocks, chain tau (sampled anchors), decode-path tau, DDTree tau per budget."""
    budgets = entries[0]["report"]["budgets"]
    width = max(10, *(len(e["label"]) for e in entries))
    head = f"{'checkpoint':<{width}}  {'blocks':>6}  {'chain':>6}  {'decode':>6}  " + "  ".join(
        f"{'T@' + str(b):>6}" for b in budgets
    )
    lines = [head]
    for e in entries:
        r = e["report"]
        decode = f"{r['decode_tau']:>6.3f}" if r.get("decode_tau") is not None else f"{'-':>6}"
        lines.append(
            f"{e['label']:<{width}}  {r['blocks']:>6}  {r['tau']:>6.3f}  {decode}  "
            + "  ".join(f"{t:>6.3f}" for t in r["ddtree_tau"])
        )
    for e in entries:  # where long context makes acceptance collapse: chain tau per context length
        buckets = e["report"].get("tau_by_context") or []
        if len(buckets) > 1:
            lines.append(
                f"{e['label']}: chain tau by context "
                + "  ".join(f"{b['context']} {b['tau']:.3f} ({b['blocks']})" for b in buckets)
            )
    for e in entries:  # the confidence head's calibration (DSpark), per draft slot
        c = e["report"].get("confidence")
        if c:
            pairs = " ".join(f"{p:.2f}/{m:.2f}" for p, m in zip(c["predicted"], c["measured"]))
            lines.append(
                f"{e['label']}: confidence predicted/measured acceptance per slot {pairs} (|error| {c['abs_error']:.3f})"
            )
    for e in entries:  # DFlash2: the target's token among the selector's K candidates, per draft slot
        c = e["report"].get("candidate_recall")
        if c:
            per = " ".join(f"{x:.2f}" for x in c["per_slot"])
            lines.append(f"{e['label']}: candidate recall per slot {per} (mean {c['mean']:.3f})")
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
    """Each checkpoint's metadata; a z-lab or speculators drafter folder (whoever wrote it) reads as one."""
    from ..export.layouts import drafter_meta

    metas = []
    for path in checkpoints:
        try:
            metas.append(drafter_meta(path))
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
        raise EvalInputError(
            f"the checkpoints were trained for different targets ({', '.join(sorted(recorded))}); "
            "evaluate them separately or pick one with --set target.path=..."
        )
    return recorded.pop()


def _check_checkpoint(path: Path, meta: dict, config, cfg):
    """The checkpoint's ``DrafterSpec`` after checking it against the target's text ``config``
    (hidden size, vocabulary, layer count): done before the target's weights are loaded."""
    from ..drafter_folder import check_against_config, checkpoint_spec

    ids = list(meta["target"]["layer_ids"])
    if cfg.target.layer_ids is not None and list(cfg.target.layer_ids) != ids:
        raise EvalInputError(
            f"checkpoint {path} was trained on target layer ids {ids}, the config asks for {list(cfg.target.layer_ids)}"
        )
    spec = checkpoint_spec(meta, config)
    # The target will hook the checkpoint's own layer ids: here the ids are checked for range and count.
    check_against_config(spec, ids, config, f"checkpoint {path}")
    trained_layers = meta["target"].get("num_layers")
    if trained_layers is not None and trained_layers != config.num_hidden_layers:
        raise EvalInputError(
            f"checkpoint {path} does not match the target: trained on a {trained_layers}-layer "
            f"target, this one has {config.num_hidden_layers} layers"
        )
    return spec


def run_eval(args: argparse.Namespace) -> int:
    """``dflash-train eval``: evaluate every checkpoint on the same rows, write the report and plots.

    Every input is checked (arguments, checkpoints against the target's config, data) before the
    target's weights are loaded: a bad input fails in seconds, even for a 54 GB target."""
    from ..config import write_resolved_config
    from ..data.documents import check_report
    from ..data.prepare import ensure_prepared, request_for
    from ..export.layouts import load_any_drafter
    from ..inference.checkpoint_eval import Checkpoint, evaluate_checkpoints
    from ..inference.regenerate import eos_ids
    from ..model.loading import load_target, load_target_config

    budgets = check_budgets(_parse_positive_ints(args.budgets, "--budgets"))
    if bool(args.data) == bool(args.benchmark):
        raise EvalInputError("give the held-out data with --data, or named sets with --benchmark NAME=PATH (not both)")
    if args.temperature is None:
        args.temperature = 1.0 if args.benchmark else 0.0
    if not 0 <= args.temperature < float("inf"):  # NaN fails it too
        raise EvalInputError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise EvalInputError(f"--top-p must be in (0, 1], got {args.top_p}")
    sample_prompts = _parse_positive_int(args.sample_prompts, "--sample-prompts")
    max_new_tokens = _parse_positive_int(args.max_new_tokens, "--max-new-tokens")
    max_blocks = _parse_positive_int(args.max_blocks_per_row, "--max-blocks-per-row")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise EvalInputError(f"--out {out} exists and is not a folder")
    cfg = resolve_config(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoints = [Path(c) for c in args.checkpoints]
    metas = _read_metas(checkpoints)
    target_path = _target_path(metas, cfg, args.overrides)
    config, tokenizer, _ = load_target_config(target_path)
    specs = [_check_checkpoint(path, meta, config, cfg) for path, meta in zip(checkpoints, metas)]

    out.mkdir(parents=True, exist_ok=True)
    min_tokens = max(s.block_size for s in specs)

    def rows_of(paths: list[str], report_path: Path):
        """Packed rows of ``paths`` (prepared once, cached), after the bad-record check."""
        request = request_for(
            cfg.data, tokenizer, config.vocab_size, min_tokens=min_tokens, train_paths=paths, holdout="none"
        )
        data = ensure_prepared(request, tokenizer, root=cfg.data.cache_dir, num_workers=cfg.data.num_workers)
        report = data.report("train")
        check_report(report, cfg.data.max_bad_fraction, report_path)
        return data.rows("train"), report

    # Inputs are checked before the target's weights load: the data's rows, or the benchmarks' records.
    benchmarks = read_benchmarks(args, cfg) if args.benchmark else []
    if args.data:  # one row set for all checkpoints, so they are compared on the same text
        rows, data_report = rows_of(args.data, out / "data_report.json")
    model, _, _ = load_target(cfg.target.model_copy(update={"path": target_path}))
    model.to(device)
    entry_of = [Checkpoint(p, label, m) for p, label, m in zip(checkpoints, unique_labels(checkpoints), metas)]

    def evaluate(rows):
        """Every checkpoint on ``rows``: one list of ``CheckpointEntry``."""
        return evaluate_checkpoints(
            model,
            entry_of,
            rows,
            # checks the drafter again, against the loaded weights' shapes
            lambda path, target: load_any_drafter(path, target)[0],
            budgets=budgets,
            max_blocks_per_row=max_blocks,
            seed=args.seed,
            attention_backend=cfg.drafter.attention_backend,
            temperature=args.temperature,
            top_p=args.top_p,
            # only sampling stops at eos: a greedy evaluation does not need the target to have one
            eos_ids=eos_ids(model, tokenizer) if args.temperature > 0 else (),
            sample_prompts=sample_prompts,
            max_new_tokens=max_new_tokens,
            log=lambda line: print(line, flush=True),
        )

    if benchmarks:
        return _run_benchmarks(
            args,
            cfg,
            out,
            benchmarks,
            model,
            tokenizer,
            target_path,
            rows_of,
            evaluate,
            budgets,
            max_new_tokens,
            max_blocks,
        )

    print(
        f"data: {data_report.n_documents} documents ({data_report.n_tokens:,} tokens), {data_report.n_bad} bad "
        f"records skipped; {len(rows)} rows of {cfg.data.seq_len} tokens; target {target_path} on {device}",
        flush=True,
    )
    entries = evaluate(rows)

    result = {
        "format": REPORT_FORMAT,
        "target": target_path,
        "data": list(args.data),
        "seq_len": cfg.data.seq_len,
        "rows": len(rows),
        "max_blocks_per_row": max_blocks,
        "seed": args.seed,
        "budgets": budgets,
        "checkpoints": entries,
    }
    atomic_write_json(out / "report.json", result)
    plot_acceptance(entries, out / "acceptance_per_slot.png")
    plot_tau_vs_budget(entries, out / "tau_vs_budget.png")
    write_resolved_config(cfg, out)
    print(format_table(entries))
    print(f"wrote {out / 'report.json'}, {out / 'acceptance_per_slot.png'}, {out / 'tau_vs_budget.png'}")
    return 0


def read_benchmarks(args: argparse.Namespace, cfg) -> list[dict]:
    """Each ``--benchmark NAME=PATH``'s records (``inference.benchmarks.read_benchmark``), read before the
    target loads so that a bad path or a set with no usable record fails in seconds."""
    from ..inference.benchmarks import parse_benchmark_spec, read_benchmark

    benchmarks = []
    for spec in args.benchmark:
        name, path = parse_benchmark_spec(spec)
        if name in {b["name"] for b in benchmarks}:
            raise EvalInputError(f"--benchmark {name} is given twice")
        records, generate, bad = read_benchmark(path, cfg.data.columns, args.prompt_key, cfg.data.max_record_bytes)
        if not records:
            reasons = sorted({b.reason for b in bad}) or ["the set is empty"]
            raise EvalInputError(f"--benchmark {name}={path}: no usable record ({'; '.join(reasons[:3])})")
        benchmarks.append({"name": name, "path": path, "records": records, "generate": generate, "bad": len(bad)})
    return benchmarks


def _answer_prompts(benchmark: dict, model, tokenizer, out: Path, max_new_tokens: int) -> Path:
    """``OUT/benchmarks/NAME.jsonl``: the benchmark's records, its prompts-only records answered by the
    target's greedy continuation (``regenerate``'s code) of at most ``max_new_tokens`` tokens."""
    from ..inference.benchmarks import record_json
    from ..inference.regenerate import regenerate_records, source_of

    records, generate = benchmark["records"], benchmark["generate"]
    todo = [r for r, g in zip(records, generate) if g]
    skipped = []
    answered = regenerate_records(
        todo, model, tokenizer, max_new_tokens=max_new_tokens, batch_size=8, progress=False, on_skip=skipped.append
    )
    answers = {record["source"]: record for record in answered}
    lines = []
    for record, needs in zip(records, generate):
        if not needs:
            lines.append(record_json(record))
            continue
        done = answers.get(source_of(record))
        if done is not None:
            lines.append({k: v for k, v in done.items() if k != "source"})
    path = out / "benchmarks" / f"{benchmark['name']}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in lines)))
    benchmark["generated"] = len(answers)
    if todo:
        print(
            f"{benchmark['name']}: the target answered {len(answers)} of {len(todo)} prompts-only records "
            f"(greedy, up to {max_new_tokens} tokens; {len(skipped)} skipped) -> {path}",
            flush=True,
        )
    return path


def format_benchmark_table(benchmarks: list[dict], overall: dict) -> str:
    """One line per (benchmark, checkpoint) and per checkpoint overall: blocks, chain tau, decode-path
    tau, DDTree tau per budget, and tau(T) expected and measured where sampled."""
    budgets = benchmarks[0]["checkpoints"][0]["report"]["budgets"]
    labels = [e["label"] for e in benchmarks[0]["checkpoints"]]
    bw = max(9, *(len(b["name"]) for b in benchmarks))
    cw = max(10, *(len(label) for label in labels))
    t = benchmarks[0]["checkpoints"][0]["report"].get("sampling", {}).get("temperature")
    sampled = f"  {'T=' + format(t, 'g') + ' exp':>9}  {'T=' + format(t, 'g') + ' meas':>10}" if t else ""
    head = f"{'benchmark':<{bw}}  {'checkpoint':<{cw}}  {'blocks':>6}  {'chain':>6}  {'decode':>6}  "
    lines = [head + "  ".join(f"{'T@' + str(b):>6}" for b in budgets) + sampled]

    def num(value, width=6):
        return f"{value:>{width}.3f}" if value is not None else f"{'-':>{width}}"

    def line(name, label, r, expected, measured):
        text = f"{name:<{bw}}  {label:<{cw}}  {r['blocks']:>6}  {num(r['tau'])}  {num(r.get('decode_tau'))}  "
        text += "  ".join(num(x) for x in r["ddtree_tau"])
        return text + (f"  {num(expected, 9)}  {num(measured, 10)}" if t else "")

    for b in benchmarks:
        for e in b["checkpoints"]:
            s = e["report"].get("sampling")
            ex = s["expected"]["tau"] if s else None
            me = s["measured"]["chain"]["tau"] if s else None
            lines.append(line(b["name"], e["label"], e["report"], ex, me))
    for label in labels:
        o = overall[label]
        s = o.get("sampling") or {}
        lines.append(line("overall", label, o, s.get("expected_tau"), s.get("measured_tau")))
    return "\n".join(lines)


def plot_benchmarks(benchmarks: list[dict], overall: dict, path: Path) -> None:
    """Chain tau per benchmark and overall, one bar per checkpoint: greedy (solid) and, where sampled,
    measured at T (hatched)."""
    from matplotlib.figure import Figure

    names = [b["name"] for b in benchmarks] + ["overall"]
    labels = [e["label"] for e in benchmarks[0]["checkpoints"]]
    t = benchmarks[0]["checkpoints"][0]["report"].get("sampling", {}).get("temperature")
    bars = len(labels) * (2 if t else 1)
    width = 0.8 / bars
    fig = Figure(figsize=(max(6.0, 1.4 * len(names) * max(1, bars / 2)), 4.2), layout="constrained")
    ax = fig.subplots()
    for i, label in enumerate(labels):
        greedy, sampled = [], []
        for b in benchmarks:
            r = next(e["report"] for e in b["checkpoints"] if e["label"] == label)
            greedy.append(r["tau"])
            sampled.append(r["sampling"]["measured"]["chain"]["tau"] if t else None)
        o = overall[label]
        greedy.append(o["tau"])
        sampled.append(o.get("sampling", {}).get("measured_tau"))
        k = i * (2 if t else 1)
        xs = [x + (k - (bars - 1) / 2) * width for x in range(len(names))]
        ax.bar(xs, greedy, width, color=f"C{i % 10}", label=f"{label} T=0")
        if t:
            xs = [x + width for x in xs]
            values = [float("nan") if v is None else v for v in sampled]
            ax.bar(xs, values, width, color=f"C{i % 10}", alpha=0.5, hatch="//", label=f"{label} T={t:g} measured")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("chain tau (tokens per target pass)")
    ax.set_title("Acceptance length per benchmark")
    ax.grid(alpha=0.3, axis="y")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))


def _run_benchmarks(
    args, cfg, out, benchmarks, model, tokenizer, target_path, rows_of, evaluate, budgets, max_new_tokens, max_blocks
) -> int:
    """``eval --benchmark``: each set answered where it is prompts only, prepared, scored by every
    checkpoint; report.json's ``benchmarks`` and ``overall``, a table and ``tau_by_benchmark.png``."""
    from ..config import write_resolved_config
    from ..inference.benchmarks import overall

    results = []
    for b in benchmarks:
        path = _answer_prompts(b, model, tokenizer, out, max_new_tokens)
        rows, report = rows_of([str(path)], out / "benchmarks" / f"{b['name']}.data_report.json")
        print(
            f"{b['name']}: {report.n_documents} documents ({report.n_tokens:,} tokens), {b['bad']} bad records "
            f"skipped; {len(rows)} rows of {cfg.data.seq_len} tokens",
            flush=True,
        )
        entries = evaluate(rows)
        results.append(
            {
                "name": b["name"],
                "path": b["path"],
                "documents": report.n_documents,
                "bad_records": b["bad"],
                "generated": b.get("generated", 0),
                "rows": len(rows),
                "checkpoints": entries,
            }
        )
    labels = [e["label"] for e in results[0]["checkpoints"]]
    totals = {
        label: overall([next(e["report"] for e in r["checkpoints"] if e["label"] == label) for r in results])
        for label in labels
    }
    result = {
        "format": REPORT_FORMAT,
        "target": target_path,
        "seq_len": cfg.data.seq_len,
        "max_blocks_per_row": max_blocks,
        "seed": args.seed,
        "budgets": budgets,
        "temperature": args.temperature,
        "benchmarks": results,
        "overall": totals,
    }
    atomic_write_json(out / "report.json", result)
    plot_benchmarks(results, totals, out / "tau_by_benchmark.png")
    write_resolved_config(cfg, out)
    print(format_benchmark_table(results, totals))
    print(f"wrote {out / 'report.json'}, {out / 'tau_by_benchmark.png'}")
    return 0


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on the main CLI's sub-parsers; its ``func`` is ``run_eval``."""
    p = subparsers.add_parser(
        "eval",
        help="teacher-forced chain and DDTree acceptance of drafter checkpoints, with plots",
        description="Measure how many drafted tokens the target would accept (chain tau, acceptance per "
        "slot, DDTree tau per budget) on held-out data, for one or more checkpoints of the same target. "
        "Writes DIR/report.json, DIR/acceptance_per_slot.png and DIR/tau_vs_budget.png.",
    )
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="drafter checkpoints or z-lab / speculators drafter folders",
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="FILE_OR_DIR",
        help="held-out JSONL (chat or pre-tokenized records), or a folder of *.jsonl; repeatable",
    )
    p.add_argument(
        "--benchmark",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a named benchmark set (JSONL / Parquet / datasets folder), scored on its own and in an overall "
        "line; repeatable, instead of --data. Prompts-only records are answered by the target first",
    )
    p.add_argument(
        "--prompt-key",
        default="prompt",
        metavar="KEY",
        help="--benchmark records without a conversation take their user turn from this column (default "
        "prompt; question for gsm8k, problem for math500)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument(
        "--budgets",
        default=",".join(map(str, DEFAULT_BUDGETS)),
        metavar="N,N,...",
        help=f"DDTree budgets (default {','.join(map(str, DEFAULT_BUDGETS))})",
    )
    p.add_argument("--max-blocks-per-row", default="64", metavar="N", help="blocks sampled per packed row (default 64)")
    p.add_argument("--seed", type=int, default=1234, help="anchor sampling seed (default 1234)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="also report tau(T) under speculative sampling, expected and measured (default: 0, greedy only, "
        "with --data; 1 with --benchmark, so both T = 0 and T = 1 are reported)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling with --temperature (default 1)"
    )
    p.add_argument(
        "--sample-prompts",
        default="8",
        metavar="N",
        help="documents whose prompts are decoded by real speculative sampling (default 8)",
    )
    p.add_argument(
        "--max-new-tokens",
        default="128",
        metavar="N",
        help="tokens sampled per prompt for the measured tau (default 128)",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add_config_args(
        p,
        default_preset="tiny-demo",
        set_help="dotted override, e.g. --set target.path=/models/qwen (default: the checkpoint's target)",
    )
    p.set_defaults(func=run_eval)
    return p
