"""``dflash-train generate``: regenerate a chat data set with the target, resumably and atomically.

Records go to ``OUT.partial``, flushed after each batch; it is renamed to ``OUT`` only when every
input record has been handled, and a rerun skips the input records whose ``"source"`` (``file:line``)
is already in ``OUT.partial``. ``OUT.report.json`` counts the records written and the records
skipped, by reason, with their ``file:line``.

``--engine vllm`` generates with vLLM offline (one ``vllm.LLM`` in a subprocess of the python that has
vLLM, ``serving.launch``), ``--server URL`` with any OpenAI-compatible server (vLLM, SGLang); both get
the token ids of the chat template applied here, once, as training reads it, and ``max_tokens``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
from pathlib import Path

from ..config import RunConfig
from ..config.cli_args import add_config_args, positive_int, resolve_config
from ..data.records import expand_paths, iter_records
from ..data.sources import count_records
from ..errors import UserError
from ..inference.regenerate import Regeneration, regenerate_into
from ..io import atomic_write_json


def _source_key(source: str) -> tuple[str, int]:
    """``"file:line"`` -> (absolute file, line): ``data/x.jsonl`` and ``./data/x.jsonl`` are one file."""
    file, _, line = source.rpartition(":")
    return str(Path(file).resolve()), int(line)


def _load_partial(partial: Path) -> set[tuple[str, int]]:
    """Sources already written to ``partial``; a line torn by a kill mid-write is cut off the file."""
    if not partial.exists():
        return set()
    done: set[tuple[str, int]] = set()
    good_bytes = 0
    with open(partial, "rb") as f:
        lines = f.readlines()
    for number, raw in enumerate(lines, 1):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("torn line")
            done.add(_source_key(json.loads(raw)["source"]))
        except (ValueError, KeyError, TypeError):
            if number == len(lines):  # only the last line can be torn by an interruption
                break
            raise UserError(f"{partial}:{number} is not an output record; delete {partial} to start over") from None
        good_bytes += len(raw)
    if good_bytes < partial.stat().st_size:
        os.truncate(partial, good_bytes)
    return done


@contextlib.contextmanager
def _writing(partial: Path):
    """A full disk or a read-only folder while writing becomes one error line; what is already in
    ``partial`` stays (only whole records, each batch fsynced) and a rerun continues from it."""
    try:
        yield
    except OSError as exc:
        raise UserError(
            f"cannot write the output next to {partial}: {exc.strerror or exc}; the records written so far "
            f"are kept in {partial}, rerun the same command to continue"
        ) from None


def _top_p(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return value


def run_generate(args: argparse.Namespace) -> int:
    """The ``generate`` sub-command: regenerate ``--input`` into ``--output``; 0 on success."""
    out = Path(args.output).expanduser()
    partial = out.with_name(out.name + ".partial")
    report_path = out.with_name(out.name + ".report.json")
    # Every check that needs no model comes first, so a typo costs no model load.
    if not out.parent.is_dir():
        raise UserError(f"output folder {out.parent} does not exist")
    files = expand_paths(args.input)
    if out.resolve() in {f.resolve() for f in files}:
        raise UserError(f"--output {out} is also an input file")
    if out.exists():
        raise UserError(f"{out} already exists (a finished run); remove it or choose another --output")
    if partial.exists() and not partial.is_file():
        raise UserError(f"{partial} exists and is not a file; remove it or choose another --output")
    if not os.access(out.parent, os.W_OK):
        raise UserError(f"output folder {out.parent} is not writable")
    if args.server and args.engine != "transformers":
        raise UserError("--server URL is its own engine: drop --engine, or drop --server")
    cfg = resolve_config(args)
    done = _load_partial(partial)
    model, tokenizer, target_folder, engine = _generator(args, cfg)

    total = count_records(files)
    if args.limit is not None:
        total = min(total, args.limit)
    records = itertools.islice(
        iter_records([str(f) for f in files], cfg.data.max_record_bytes, cfg.data.columns), args.limit
    )
    todo = (r for r in records if (str(Path(r.source).resolve()), r.line) not in done)

    with _writing(partial), open(partial, "a", encoding="utf-8") as f:

        def write(records: list[dict]) -> None:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            # A kill loses at most the batch in flight: everything before it is on disk.
            f.flush()
            os.fsync(f.fileno())

        run = regenerate_into(
            todo,
            model,
            tokenizer,
            write,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            progress=not args.no_progress,
            total=max(total - len(done), 0),
            engine=engine,
        )
    if engine is not None:
        engine.close()
    report = _report(args, out, files, target_folder, len(done), run)
    # Report first, then the rename: once OUT exists, its report does too.
    with _writing(partial):
        atomic_write_json(report_path, report)
        os.replace(partial, out)
    print(
        f"wrote {report['records_written']} records to {out} ({len(done)} resumed, {run.generated} generated in "
        f"{run.seconds:.1f} s, {report['records_per_second']} records/s, {run.stats.new_tokens} new tokens)"
    )
    for reason, srcs in sorted(run.skipped.items()):
        shown = ", ".join(srcs[:3]) + (", ..." if len(srcs) > 3 else "")
        print(f"skipped {len(srcs)}: {reason} ({shown})")
    print(f"report: {report_path}")
    return 0


def _report(
    args: argparse.Namespace, out: Path, files: list[Path], target_folder: Path | str, resumed: int, run: Regeneration
) -> dict:
    """``OUT.report.json``: the settings, the records written (resumed + generated), skipped (by
    reason, with their ``file:line``) and the generation's counters and rates."""
    seconds = run.seconds
    return {
        "output": str(out),
        "inputs": [str(f) for f in files],
        "target": str(target_folder),
        "settings": {
            "engine": f"server {args.server}" if args.server else args.engine,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "seed": args.seed,
            "limit": args.limit,
        },
        "records_written": resumed + run.generated,
        "records_resumed": resumed,
        "records_generated": run.generated,
        "records_skipped": sum(len(v) for v in run.skipped.values()),
        "skipped": {reason: {"count": len(srcs), "records": srcs} for reason, srcs in sorted(run.skipped.items())},
        "assistant_turns": run.stats.turns,
        "truncated_turns": run.stats.truncated_turns,
        "new_tokens": run.stats.new_tokens,
        "seconds": round(seconds, 3),
        "records_per_second": round(run.generated / seconds, 3) if seconds > 0 else None,
        "new_tokens_per_second": round(run.stats.new_tokens / seconds, 1) if seconds > 0 else None,
    }


def _generator(args: argparse.Namespace, cfg: RunConfig):
    """``(model, tokenizer, target folder, engine)``: the target loaded here on ``--device`` (engine
    None), or a weightless stand-in for the engine that generates elsewhere (``--engine vllm``,
    ``--server URL``)."""
    if not args.server and args.engine == "transformers":
        import torch

        from ..model.loading import load_target

        model, tokenizer, target_folder = load_target(cfg.target)
        model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return model, tokenizer, target_folder, None
    from ..serving.engines import ServerEngine, VllmEngine

    model, tokenizer, target_folder = _engine_target(cfg.target.path)
    engine = ServerEngine(args.server) if args.server else VllmEngine(target_folder, dtype=cfg.target.dtype)
    return model, tokenizer, target_folder, engine


def _engine_target(path: str | None):
    """``(stand-in model, tokenizer, folder)`` for an engine that runs the target elsewhere: what the
    prompts need here (tokenizer, chat template, eos ids, context length) without loading weights."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from ..model.loading import load_target_config

    config, tokenizer, folder = load_target_config(path)
    try:
        generation = GenerationConfig.from_pretrained(folder, local_files_only=True)
    except OSError:
        generation = GenerationConfig()
    return SimpleNamespace(config=config, generation_config=generation), tokenizer, folder


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``generate`` on the main CLI's sub-parsers; its ``func`` is ``run_generate``."""
    p = subparsers.add_parser(
        "generate",
        help="regenerate the assistant turns of a chat data set with the target",
        description="Replace every assistant turn of chat JSONL records with the target's own output "
        "(DFlash drafters learn the target's distribution). Writes OUT.partial, resumes from it on a "
        "rerun, renames it to OUT at the end, and writes OUT.report.json.",
    )
    add_config_args(
        p,
        default_preset="tiny-demo",
        set_help="dotted override applied after all --config files, e.g. --set target.path=/models/qwen",
    )
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="PATH",
        help="JSONL file or folder of *.jsonl; repeat for several",
    )
    p.add_argument("--output", required=True, metavar="OUT.jsonl", help="output JSONL (its folder must exist)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per assistant turn (default 256)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="records generated together (default 8)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass when sampling (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the first N input records")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="transformers (default, in process) or vllm (offline vllm.LLM in a subprocess of "
        "DFLASH_VLLM_PYTHON or this python; scale past one GPU with vLLM's own parallelism)",
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="generate with an OpenAI-compatible server (vLLM, SGLang) serving the target, e.g. http://127.0.0.1:8000",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_generate)
    return p
