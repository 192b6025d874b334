"""Regenerate the assistant turns of a chat data set with the target (``dflash-train generate``).

A DFlash drafter learns to predict what the *target* would say, so its training data should be the
target's own outputs, not the text some other model wrote. For every chat record this module replays
the conversation and replaces each assistant turn, in order, by the target's continuation of
everything before it (earlier assistant turns already replaced):

    prompt_k = chat_template(messages[:k] with assistant turns regenerated, add_generation_prompt=True)
    assistant_k = decode(target.generate(prompt_k), skip_special_tokens=True)

Records are batched: each round generates the next assistant turn of every conversation in the batch
with one HF ``model.generate`` call (KV cache, LEFT padding plus an attention mask, stopping at the
generation config's eos ids). HF derives the position ids from the attention mask
(``cumsum - 1``), so a left-padded prompt sees the same positions as alone: in float32, greedy
batched and unbatched logits are bit-identical (tested). In bfloat16 the batched matmuls round
differently (one ulp, about 0.06 at logit 14), which can flip an exact tie between two tokens;
that is rounding, not padding, and it is inherent to low-precision batching.

``dflash-train generate`` writes the records to ``OUT.partial``, flushing after each batch, renames it
to ``OUT`` only when every input record has been handled, and on a rerun skips the input records whose
``"source"`` (``file:line``) is already in ``OUT.partial``. ``OUT.report.json`` counts the records
written and the records skipped, by reason, with their ``file:line``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path

from .config.cli_args import add_config_args, resolve_config
from .data.records import BadRecord, Record, expand_paths, iter_records
from .errors import UserError

# Skip reasons (stable strings: they are the keys of the report's "skipped" section).
SKIP_PRETOKENIZED = "pre-tokenized (no messages to regenerate)"
SKIP_EMPTY = "empty generation"
SKIP_TOO_LONG = "prompt plus max_new_tokens longer than the target's context"
SKIP_TEMPLATE = "chat template failed"


@dataclass(frozen=True)
class Skipped:
    """An input record that produced no output record, and why."""

    source: str  # "file:line"
    reason: str


@dataclass
class GenerationStats:
    """Counters a caller may pass in to learn what the generation did."""

    turns: int = 0  # assistant turns regenerated
    new_tokens: int = 0  # tokens generated, eos excluded
    truncated_turns: int = 0  # turns that hit max_new_tokens before an eos
    generate_calls: int = 0


def source_of(record: Record | BadRecord) -> str:
    """``"file:line"`` of an input record: the key that output records carry and resume matches."""
    return f"{record.source}:{record.line}"


def _eos_ids(model, tokenizer) -> list[int]:
    """The generation config's eos ids (a list in chat models: e.g. <|endoftext|> and <|im_end|>)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the target has no eos token in its generation config or tokenizer: generation cannot stop")
    return [eos] if isinstance(eos, int) else list(eos)


class _Generator:
    """Batched generation of prompt strings with fixed settings; the one place that calls ``model.generate``."""

    def __init__(self, model, tokenizer, *, max_new_tokens, temperature, top_p, seed, stats):
        import torch

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self.torch, self.model, self.tokenizer = torch, model, tokenizer
        self.max_new_tokens, self.seed, self.stats = max_new_tokens, seed, stats
        self.eos = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad = self.eos[0] if pad is None else pad  # padded slots are masked out, any id works
        self.context = getattr(model.config, "max_position_embeddings", None)
        if temperature == 0:
            # Neutral sampling fields, so a model whose generation config samples (e.g. Qwen3's
            # temperature 0.6) neither warns nor changes anything under greedy decoding.
            self.kwargs = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=None)
        else:
            # HF would otherwise apply its global default top_k=50 on top of top_p; keep a top_k only
            # when the target's own generation config asks for one.
            self.kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p,
                               top_k=getattr(model.generation_config, "top_k", None) or 0)

    def encode(self, messages: list[dict]) -> list[int]:
        """Token ids of the chat prompt that asks for the next assistant turn after ``messages``."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already holds every special token the model expects; add none.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fits(self, ids: list[int]) -> bool:
        return self.context is None or len(ids) + self.max_new_tokens <= self.context

    def generate(self, prompts: list[list[int]]) -> list[str]:
        """One ``model.generate`` call over left-padded ``prompts``; decoded texts, cut at the first eos.

        input_ids, attention_mask: [n, max_len], pad on the left so every row's next token is at the end.
        """
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        device = self.model.device
        # Seed each call from (seed, call index) inside a forked RNG: sampling is reproducible for the
        # same input and batch size, and the caller's global RNG state is left untouched.
        devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(self.seed * 1_000_003 + self.stats.generate_calls)
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=self.max_new_tokens,
                eos_token_id=self.eos, pad_token_id=self.pad, use_cache=True, **self.kwargs,
            )
        self.stats.generate_calls += 1
        texts = []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos), None)
            self.stats.turns += 1
            self.stats.new_tokens += len(row) if end is None else end
            self.stats.truncated_turns += end is None
            texts.append(self.tokenizer.decode(row[:end], skip_special_tokens=True))
        return texts


def _regenerate_batch(records: list[Record], gen: _Generator) -> list[dict | Skipped]:
    """Regenerate every assistant turn of ``records`` (one batch), round by round; results in input order.

    Round r generates, in one call, the r-th assistant turn of every conversation that has one, so the
    prompt of each turn already holds that conversation's earlier regenerated turns.
    """
    messages = [[dict(m) for m in r.messages] for r in records]
    todo = [[i for i, m in enumerate(ms) if m["role"] == "assistant"] for ms in messages]
    failed: dict[int, str] = {}
    for rnd in range(max(len(t) for t in todo)):
        rows, prompts = [], []
        for j, turns in enumerate(todo):
            if j in failed or rnd >= len(turns):
                continue
            try:
                ids = gen.encode(messages[j][: turns[rnd]])
            except Exception as exc:  # any template error is this record's problem, not the run's
                failed[j] = f"{SKIP_TEMPLATE}: {type(exc).__name__}"
                continue
            if not gen.fits(ids):
                failed[j] = SKIP_TOO_LONG
                continue
            rows.append(j)
            prompts.append(ids)
        for j, text in zip(rows, gen.generate(prompts) if rows else []):
            if not text.strip():
                failed[j] = SKIP_EMPTY  # nothing to learn from; later turns would build on nothing
            messages[j][todo[j][rnd]]["content"] = text
    results: list[dict | Skipped] = []
    for j, record in enumerate(records):
        if j in failed:
            results.append(Skipped(source_of(record), failed[j]))
        else:
            # The input's other keys first, so "messages" and "source" always hold what this module wrote.
            results.append({**record.extra, "messages": messages[j], "source": source_of(record)})
    return results


def regenerate_batches(
    records: Iterable[Record | BadRecord], model, tokenizer, *, max_new_tokens: int, batch_size: int,
    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, progress: bool = True,
    total: int | None = None, stats: GenerationStats | None = None,
) -> Iterator[list[dict | Skipped]]:
    """Like ``regenerate_records``, one list per batch of ``batch_size`` chat records (for writers that flush).

    Each list holds, in input order, the output records of the batch and a ``Skipped`` for every input
    record that gave none (bad records, pre-tokenized records, empty generations, prompts too long).
    ``total`` sizes the progress bar (input records, skipped ones included).
    """
    from tqdm import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    gen = _Generator(model, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                     seed=seed, stats=stats if stats is not None else GenerationStats())
    bar = tqdm(total=total, unit="rec", desc="generate", disable=not progress, dynamic_ncols=True)

    def flush(pending: list) -> list[dict | Skipped]:
        chat = [r for r in pending if isinstance(r, Record)]
        done = iter(_regenerate_batch(chat, gen) if chat else [])
        out = [next(done) if isinstance(r, Record) else r for r in pending]
        bar.update(len(out))
        return out

    pending: list[Record | Skipped] = []  # input order; skipped records wait so the order is kept
    n_chat = 0
    try:
        for record in records:
            if isinstance(record, BadRecord):
                pending.append(Skipped(source_of(record), f"bad record: {record.reason}"))
            elif record.messages is None:
                pending.append(Skipped(source_of(record), SKIP_PRETOKENIZED))
            else:
                pending.append(record)
                n_chat += 1
            if n_chat == batch_size:
                yield flush(pending)
                pending, n_chat = [], 0
        if pending:
            yield flush(pending)
    finally:
        bar.close()


def regenerate_records(
    records: Iterable[Record | BadRecord], model, tokenizer, *, max_new_tokens: int, batch_size: int,
    temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, progress: bool = True,
    on_skip: Callable[[Skipped], None] | None = None, stats: GenerationStats | None = None,
) -> Iterator[dict]:
    """Output records: each chat record with every assistant turn regenerated by the target.

    records: ``Record``/``BadRecord`` as ``data.records.iter_records`` yields them.
    Greedy when ``temperature == 0``, else sampling with ``temperature``/``top_p``, seeded by ``seed``.
    An output record is the input's extra keys plus ``"messages"`` (regenerated) and ``"source"``
    (``"file:line"`` of the input). Records that give no output are passed to ``on_skip``.
    """
    total = len(records) if isinstance(records, Sized) else None
    for batch in regenerate_batches(records, model, tokenizer, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                    temperature=temperature, top_p=top_p, seed=seed, progress=progress,
                                    total=total, stats=stats):
        for item in batch:
            if isinstance(item, Skipped):
                if on_skip is not None:
                    on_skip(item)
            else:
                yield item


# ---------------------------------------------------------------------------------------------------
# The command: resumable, atomic writing of OUT plus its report.


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


def _count_records(files: list[Path]) -> int:
    """Non-blank lines, i.e. what ``iter_records`` will yield (sizes the progress bar)."""
    n = 0
    for file in files:
        with open(file, "rb") as f:
            n += sum(1 for line in f if line.strip())
    return n


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _top_p(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run_generate(args: argparse.Namespace) -> int:
    """The ``generate`` sub-command: regenerate ``--input`` into ``--output``; 0 on success."""
    if getattr(args, "speculative", None):
        from .speculative import run_speculative

        return run_speculative(args, resolve_config(args))
    out = Path(args.output).expanduser()
    partial = out.with_name(out.name + ".partial")
    report_path = out.with_name(out.name + ".report.json")
    # Every check that needs no model comes first, so a typo costs no model load.
    if not out.parent.is_dir():
        raise UserError(f"output folder {out.parent} does not exist")
    if out.exists():
        raise UserError(f"{out} already exists (a finished run); remove it or choose another --output")
    files = expand_paths(args.input)
    if out.resolve() in {f.resolve() for f in files}:
        raise UserError(f"--output {out} is also an input file")
    cfg = resolve_config(args)
    done = _load_partial(partial)

    import torch

    from .target_loading import load_target

    model, tokenizer, target_folder = load_target(cfg.target)
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    total = _count_records(files)
    if args.limit is not None:
        total = min(total, args.limit)
    records = itertools.islice(iter_records([str(f) for f in files]), args.limit)
    todo = (r for r in records if (str(Path(r.source).resolve()), r.line) not in done)

    stats = GenerationStats()
    skipped: dict[str, list[str]] = {}
    written = len(done)
    start = time.perf_counter()
    with open(partial, "a", encoding="utf-8") as f:
        for batch in regenerate_batches(
            todo, model, tokenizer, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, progress=not args.no_progress,
            total=max(total - len(done), 0), stats=stats,
        ):
            for item in batch:
                if isinstance(item, Skipped):
                    skipped.setdefault(item.reason, []).append(item.source)
                else:
                    f.write(json.dumps(item, ensure_ascii=False) + "\n")
                    written += 1
            # A kill loses at most the batch in flight: everything before it is on disk.
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    generated = written - len(done)
    report = {
        "output": str(out),
        "inputs": [str(f) for f in files],
        "target": str(target_folder),
        "settings": {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                     "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "limit": args.limit},
        "records_written": written,
        "records_resumed": len(done),
        "records_generated": generated,
        "records_skipped": sum(len(v) for v in skipped.values()),
        "skipped": {reason: {"count": len(srcs), "records": srcs} for reason, srcs in sorted(skipped.items())},
        "assistant_turns": stats.turns,
        "truncated_turns": stats.truncated_turns,
        "new_tokens": stats.new_tokens,
        "seconds": round(seconds, 3),
        "records_per_second": round(generated / seconds, 3) if seconds > 0 else None,
        "new_tokens_per_second": round(stats.new_tokens / seconds, 1) if seconds > 0 else None,
    }
    # Report first, then the rename: once OUT exists, its report does too.
    _write_json_atomic(report_path, report)
    os.replace(partial, out)
    print(f"wrote {written} records to {out} ({len(done)} resumed, {generated} generated in {seconds:.1f} s, "
          f"{report['records_per_second']} records/s, {stats.new_tokens} new tokens)")
    for reason, srcs in sorted(skipped.items()):
        shown = ", ".join(srcs[:3]) + (", ..." if len(srcs) > 3 else "")
        print(f"skipped {len(srcs)}: {reason} ({shown})")
    print(f"report: {report_path}")
    return 0


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``generate`` on the main CLI's sub-parsers; its ``func`` is ``run_generate``."""
    p = subparsers.add_parser(
        "generate", help="regenerate the assistant turns of a chat data set with the target",
        description="Replace every assistant turn of chat JSONL records with the target's own output "
        "(DFlash drafters learn the target's distribution). Writes OUT.partial, resumes from it on a "
        "rerun, renames it to OUT at the end, and writes OUT.report.json.",
    )
    add_config_args(p, default_preset="tiny-demo",
                    set_help="dotted override applied after all --config files, e.g. --set target.path=/models/qwen")
    p.add_argument("--input", action="append", required=True, metavar="PATH",
                   help="JSONL file or folder of *.jsonl; repeat for several")
    p.add_argument("--output", required=True, metavar="OUT.jsonl", help="output JSONL (its folder must exist)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="per assistant turn (default 256)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="records generated together (default 8)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass when sampling (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="only the first N input records")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--speculative", choices=["chain", "ddtree"], default=None,
                   help="instead of regenerating: decode the prompts greedily with the target and speculatively "
                   "with --drafter, check they agree, and report tau, tokens/s and the speedup")
    p.add_argument("--drafter", metavar="CHECKPOINT", default=None, help="drafter checkpoint for --speculative")
    p.add_argument("--budget", type=int, action="append", default=None, metavar="N",
                   help="DDTree node budget; repeat for several (default 64)")
    p.set_defaults(func=run_generate)
    return p
