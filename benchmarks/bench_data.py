"""The data path at corpus scale: prepared, memory-mapped storage vs the in-memory reference.

    .venv/bin/python benchmarks/bench_data.py                 # 50 M tokens; writes results/data.{json,md}
    .venv/bin/python benchmarks/bench_data.py --tokens 2e6    # a quick look (not written unless --write)

A synthetic chat corpus (Python standard-library source as assistant turns of ~3,400 tokens, like the
issue's measurement; generated here, not committed) is tokenized with the embedded tiny target's
tokenizer and chat template. Every measurement runs in its own process, one after the other:

- prepare: ``prepare_data`` with 1 and 2 workers (tokens/s; the outputs are compared byte for byte);
- reference: today's path before this storage, ``load_documents`` + ``pack_documents`` (time and the
  anonymous memory it holds per token);
- read: a training-time reader (``RowStream`` + ``StepPlan`` over the memory-mapped rows, as a rank
  reads them) at two corpus sizes: anonymous resident memory per corpus token (the page cache of the
  mapped files is reported apart: the kernel can drop it), and microseconds per row read;
- time to the first step: with the target loaded, ``open_training_data`` + ``Trainer`` + one step, on a
  first run (prepares into an empty cache) and a second run (finds it there: no re-tokenizing);
- step time: training steps with the rows read from the memory map vs the same rows as a list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS_PER_RECORD = 3400


def proc_status() -> dict[str, int]:
    """RssAnon / RssFile / VmHWM of this process, bytes (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def tiny_tokenizer():
    from transformers import AutoTokenizer

    from dflash_trainer.tiny_target import tiny_target_path

    return AutoTokenizer.from_pretrained(tiny_target_path(), local_files_only=True)


def write_corpus(path: Path, tokens: float) -> int:
    """Chat records until about ``tokens`` tokens; returns the record count. Text: stdlib sources,
    cycled, in chunks sized from the tokenizer's measured characters per token."""
    from dflash_trainer.tiny_target.corpus import iter_stdlib_files

    tok = tiny_tokenizer()
    files = iter_stdlib_files()
    sample = "".join(f.read_text(errors="replace") for f in files[:20])[:200_000]
    chars = int(TOKENS_PER_RECORD * len(sample) / len(tok(sample)["input_ids"]))
    n_records = max(20, int(tokens / TOKENS_PER_RECORD))
    written, text, i = 0, "", 0
    with open(path, "w", encoding="utf-8") as f:
        while written < n_records:
            while len(text) < chars:
                text += files[i % len(files)].read_text(errors="replace")
                i += 1
            answer, text = text[:chars], text[chars:]
            record = {
                "messages": [
                    {"role": "user", "content": f"Explain part {written}."},
                    {"role": "assistant", "content": answer},
                ]
            }
            f.write(json.dumps(record) + "\n")
            written += 1
    return n_records


def request_for_corpus(corpus: Path, seq_len: int = 4096):
    from dflash_trainer.config import load_config
    from dflash_trainer.data.prepare import request_for

    tok = tiny_tokenizer()
    cfg = load_config(["tiny-demo"], [f"data.train_files=[{corpus}]", f"data.seq_len={seq_len}"])
    return request_for(cfg.data, tok, len(tok), min_tokens=cfg.drafter.block_size + 1), tok


# -- workers (one process each) --------------------------------------------------------------------


def work_prepare(corpus: Path, out: Path, workers: int) -> dict:
    from dflash_trainer.data.prepare import prepare_data

    request, tok = request_for_corpus(corpus)
    t0 = time.perf_counter()
    prepare_data(request, tok, out, num_workers=workers, progress=False)
    elapsed = time.perf_counter() - t0
    m = json.loads((out / "manifest.json").read_text())
    disk = sum(f["bytes"] for f in m["files"].values())
    return {"seconds": elapsed, "tokens": m["n_tokens"], "disk_bytes": disk, "peak_rss": proc_status()["VmHWM"]}


def work_reference(corpus: Path) -> dict:
    from dflash_trainer.data.documents import load_documents
    from dflash_trainer.data.packing import pack_documents

    request, tok = request_for_corpus(corpus)
    before = proc_status()["RssAnon"]
    t0 = time.perf_counter()
    docs, report = load_documents(
        [str(corpus)], tok, vocab_size=len(tok), min_tokens=request.min_tokens, max_bad_fraction=1.0
    )
    t_docs = time.perf_counter() - t0
    after_docs = proc_status()["RssAnon"]
    rows = pack_documents(docs, request.seq_len, request.pad_token_id)
    elapsed = time.perf_counter() - t0
    after = proc_status()["RssAnon"]
    n = report.n_tokens
    return {
        "seconds": elapsed,
        "tokenize_seconds": t_docs,
        "tokens": n,
        "rows": len(rows),
        "anon_bytes_per_token_documents": (after_docs - before) / n,
        "anon_bytes_per_token_total": (after - before) / n,
    }


def work_read(folder: Path, steps: int, grad_accum: int) -> dict:
    """Read rows as a training rank does: RowStream over the memory map, StepPlan's usability checks."""
    from dflash_trainer.data.storage import PreparedData
    from dflash_trainer.training.distributed import StepPlan
    from dflash_trainer.training.trainer import RowStream

    before = proc_status()
    data = PreparedData(folder)
    rows = data.rows("train")
    stream = RowStream(rows, seed=0)
    plan = StepPlan(stream, len(rows), block_size=8, grad_accum=grad_accum)
    t0 = time.perf_counter()
    n_read = 0
    for _ in range(steps):
        for g in plan.step()[0]:
            row = stream[g]
            n_read += 1
            assert row.input_ids.numel() == data.settings["seq_len"]
    elapsed = time.perf_counter() - t0
    after = proc_status()
    n = data.manifest["n_tokens"]
    return {
        "tokens": n,
        "rows": len(rows),
        "rows_read": n_read,
        "us_per_row": elapsed / n_read * 1e6,
        "anon_bytes": after["RssAnon"] - before["RssAnon"],
        "anon_bytes_per_token": (after["RssAnon"] - before["RssAnon"]) / n,
        "file_bytes": after["RssFile"] - before["RssFile"],
    }


def work_first_step(corpus: Path, cache: Path, out: Path) -> dict:
    """A training run's start with the target already loaded: the data (prepared, or found in the
    cache), the trainer, the first optimizer step; seconds from the start to each."""
    import torch

    from dflash_trainer.config import load_config
    from dflash_trainer.model.loading import load_target_model
    from dflash_trainer.training.setup import open_training_data
    from dflash_trainer.training.trainer import Trainer

    torch.set_num_threads(2)
    sets = [f"data.train_files=[{corpus}]", "data.seq_len=4096", f"data.cache_dir={cache}", f"output_dir={out}"]
    cfg = load_config(["tiny-demo"], sets)
    target, tok = load_target_model(cfg.target)
    t0 = time.perf_counter()
    train_rows, eval_rows, _ = open_training_data(cfg, tok, target.vocab_size, progress=False)
    t_data = time.perf_counter() - t0
    trainer = Trainer(cfg, target, tok, train_rows, eval_rows, out_dir=out, target_path=None, progress=False)
    trainer.train_step()
    return {"data_s": t_data, "to_first_step_s": time.perf_counter() - t0, "rows": len(train_rows)}


class Prefix(Sequence):
    """The first ``n`` rows of a memory-mapped row set, still read from the map on every access."""

    def __init__(self, rows, n: int):
        self.rows, self.n = rows, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        return self.rows[range(self.n)[i]]


def work_steps(folder: Path, steps: int) -> dict:
    """s/step of the tiny-demo trainer with rows from the memory map vs the same rows in a list."""
    import torch

    from dflash_trainer.config import load_config
    from dflash_trainer.data.storage import PreparedData
    from dflash_trainer.model.loading import load_target_model
    from dflash_trainer.training.trainer import Trainer

    torch.set_num_threads(2)
    data = PreparedData(folder)
    mapped = data.rows("train")
    listed = mapped[: min(len(mapped), 64)]
    cfg = load_config(["tiny-demo"], ["data.seq_len=4096", "data.train_files=[unused]"])
    target, tok = load_target_model(cfg.target)
    times: dict[str, list[float]] = {"memory map": [], "list": []}
    with tempfile.TemporaryDirectory() as out:
        trainers = {
            "memory map": Trainer(
                cfg,
                target,
                tok,
                Prefix(mapped, len(listed)),
                listed,
                out_dir=Path(out),
                target_path=None,
                progress=False,
            ),
            "list": Trainer(cfg, target, tok, listed, listed, out_dir=Path(out), target_path=None, progress=False),
        }
        for trainer in trainers.values():
            trainer.train_step()  # warm-up
        for _ in range(steps):
            for name, trainer in trainers.items():
                t0 = time.perf_counter()
                trainer.train_step()
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


# -- orchestration ----------------------------------------------------------------------------------


def run_worker(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", *args], capture_output=True, text=True, timeout=7200, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=50e6, help="corpus size (tokens, about)")
    ap.add_argument("--small-tokens", type=float, default=10e6, help="the second, smaller corpus of the read test")
    ap.add_argument("--write", action="store_true", help="write results even for a non-default size")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--render", action="store_true", help="only rewrite results/data.md from results/data.json")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        write_results(json.loads((RESULTS / "data.json").read_text()), args)
        return
    if args.worker:
        kind, *rest = args.worker
        if kind == "prepare":
            result = work_prepare(Path(rest[0]), Path(rest[1]), int(rest[2]))
        elif kind == "reference":
            result = work_reference(Path(rest[0]))
        elif kind == "read":
            result = work_read(Path(rest[0]), int(rest[1]), int(rest[2]))
        elif kind == "first-step":
            result = work_first_step(Path(rest[0]), Path(rest[1]), Path(rest[2]))
        else:
            result = work_steps(Path(rest[0]), int(rest[1]))
        print(json.dumps(result))
        return

    results: dict = {"machine": {"cpus": os.cpu_count(), "load_average_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        corpora = {}
        for label, tokens in (("large", args.tokens), ("small", args.small_tokens)):
            path = tmp / f"{label}.jsonl"
            t0 = time.perf_counter()
            records = write_corpus(path, tokens)
            corpora[label] = path
            print(
                f"{label} corpus: {records:,} records, {path.stat().st_size / 1e6:,.0f} MB ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        big = corpora["large"]
        prepared = {}
        for workers in (1, 2):
            out = tmp / f"prepared-{workers}"
            prepared[workers] = run_worker("prepare", str(big), str(out), str(workers))
            r = prepared[workers]
            print(
                f"prepare, {workers} worker(s): {r['seconds']:.1f} s, {r['tokens'] / r['seconds'] / 1e3:,.0f}K tokens/s",
                flush=True,
            )
        identical = all(
            (tmp / "prepared-1" / f.name).read_bytes() == f.read_bytes()
            for f in (tmp / "prepared-2").iterdir()
            if f.name != "stamps.json"
        )
        results["prepare"] = {str(k): v for k, v in prepared.items()}
        results["prepare_identical_1_vs_2_workers"] = identical
        if not args.skip_reference:
            ref = run_worker("reference", str(big))
            results["reference"] = ref
            print(
                f"reference load_documents + pack_documents: {ref['seconds']:.1f} s, {ref['anon_bytes_per_token_total']:.1f} bytes/token",
                flush=True,
            )
        small_out = tmp / "prepared-small"
        run_worker("prepare", str(corpora["small"]), str(small_out), "2")
        results["read"] = {
            label: run_worker("read", str(folder), "200", "4")
            for label, folder in (("small", small_out), ("large", tmp / "prepared-1"))
        }
        for label, r in results["read"].items():
            print(
                f"read ({label}, {r['tokens']:,} tokens): {r['anon_bytes'] / 1e6:.1f} MB anon = {r['anon_bytes_per_token']:.3f} bytes/token, {r['us_per_row']:.0f} us/row",
                flush=True,
            )

        cache = tmp / "cache"
        results["time_to_first_step"] = {
            run: run_worker("first-step", str(big), str(cache), str(tmp / f"run-{run}")) for run in ("first", "second")
        }
        for run, r in results["time_to_first_step"].items():
            print(
                f"{run} run: data ready in {r['data_s']:.2f} s, first step done {r['to_first_step_s']:.2f} s after the start",
                flush=True,
            )
        results["step_s"] = run_worker("steps", str(tmp / "prepared-1"), "5")
        print(f"step time: {results['step_s']}", flush=True)
    results["machine"]["load_average_end"] = os.getloadavg()
    if args.tokens == 50e6 or args.write:
        write_results(results, args)


def write_results(r: dict, args) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data.json").write_text(json.dumps(r, indent=2) + "\n")
    p1, p2 = r["prepare"]["1"], r["prepare"]["2"]
    lines = [
        "# The data path at corpus scale",
        "",
        f"`.venv/bin/python benchmarks/bench_data.py` (this machine: {r['machine']['cpus']} cores; load average "
        f"{r['machine']['load_average_start'][0]:.1f} at the start, {r['machine']['load_average_end'][0]:.1f} at the end). "
        f"Corpus: {p1['tokens'] / 1e6:,.1f} M tokens of chat records (~{TOKENS_PER_RECORD:,} tokens each), the tiny target's tokenizer. "
        "Other agents' jobs shared the machine during the later measurements (the load average above): times are "
        "from one run each; the memory figures do not depend on the load.",
        "",
        "| | time | tokens/s | memory |",
        "|---|---|---|---|",
        f"| prepare, 1 worker | {p1['seconds']:.1f} s | {p1['tokens'] / p1['seconds'] / 1e3:,.0f} K | peak RSS {p1['peak_rss'] / 1e6:,.0f} MB |",
        f"| prepare, 2 workers | {p2['seconds']:.1f} s | {p2['tokens'] / p2['seconds'] / 1e3:,.0f} K | peak RSS {p2['peak_rss'] / 1e6:,.0f} MB (main process) |",
    ]
    if "reference" in r:
        ref = r["reference"]
        lines.append(
            f"| reference `load_documents` + `pack_documents` | {ref['seconds']:.1f} s | {ref['tokens'] / ref['seconds'] / 1e3:,.0f} K | "
            f"{ref['anon_bytes_per_token_total']:.1f} bytes/token held ({ref['anon_bytes_per_token_documents']:.1f} documents + packing) |"
        )
    lines += [
        "",
        f"1 vs 2 workers: byte-identical storage: {r['prepare_identical_1_vs_2_workers']}. Disk: "
        f"{p1['disk_bytes'] / 1e6:,.0f} MB = {p1['disk_bytes'] / p1['tokens']:.2f} bytes/token.",
        "",
        "Training-time reading (RowStream + StepPlan over the memory map, 200 steps x 4 rows):",
        "",
        "| corpus | rows | anonymous RSS added | per corpus token | file-backed pages touched (the map and libraries: page cache) | per row read |",
        "|---|---|---|---|---|---|",
    ]
    for label in ("small", "large"):
        x = r["read"][label]
        lines.append(
            f"| {x['tokens'] / 1e6:,.1f} M tokens | {x['rows']:,} | {x['anon_bytes'] / 1e6:.1f} MB | {x['anon_bytes_per_token']:.3f} B | "
            f"{x['file_bytes'] / 1e6:.0f} MB | {x['us_per_row']:.0f} us |"
        )
    f1, f2 = r["time_to_first_step"]["first"], r["time_to_first_step"]["second"]
    lines += [
        "",
        f"Time to the first training step (target loaded; `open_training_data` + `Trainer` + one step): first run "
        f"{f1['to_first_step_s']:.1f} s (data prepared in {f1['data_s']:.1f} s), second run {f2['to_first_step_s']:.2f} s "
        f"(data found in the cache and opened in {f2['data_s']:.2f} s: no re-tokenizing).",
        "",
        f"Step time (tiny-demo drafter, 4,096-token rows, median of 5): rows from the memory map "
        f"{r['step_s']['memory map']:.3f} s, the same rows as a list {r['step_s']['list']:.3f} s.",
        "",
    ]
    (RESULTS / "data.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
