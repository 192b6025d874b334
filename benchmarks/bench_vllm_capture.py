"""Feature capture in-process (transformers) vs vLLM (``capture --engine vllm``) on the tiny target.

The same rows, the same settings, one ``dflash-train capture`` process each, side by side in one run:
the capture's own tokens/s line (the rows' forward passes and the shard writes; vLLM's engine start is
timed apart, as it is paid once per capture) for each engine and dtype, and the ratio. The vLLM side
is vLLM's CPU build (``DFLASH_VLLM_PYTHON``, else tests' ``.venv/vllm``), in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

Then the bounded window (``data.feature_window``): vLLM captures while a drafter trains from the same
folder (float32), the folder's training shards sampled every 20 ms; their largest total against the
complete cache of the same rows.

    python benchmarks/bench_vllm_capture.py [--rows 300] [--seq-len 512] [--dtypes float32,bfloat16]
                                                # writes benchmarks/results/vllm_capture.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))


def capture(data: Path, out: Path, seq_len: int, dtype: str, engine: str, env: dict) -> dict:
    cmd = [sys.executable, "-m", "dflash_trainer.cli", "capture", "--config", "tiny-demo", "--no-progress"]
    cmd += ["--out", str(out), "--engine", engine]
    for item in (
        f"data.train_files=[{data}]",
        f"data.seq_len={seq_len}",
        f"target.dtype={dtype}",
        "data.max_eval_rows=4",
    ):
        cmd += ["--set", item]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise SystemExit(f"{engine} {dtype} capture failed: {run.stderr[-2000:]}")
    m = re.search(r"capture: ([\d,]+) rows \(([\d,]+) tokens\) in ([\d.]+) s", run.stdout)
    rows, tokens, seconds = int(m[1].replace(",", "")), int(m[2].replace(",", "")), float(m[3])
    return {"rows": rows, "tokens": tokens, "capture_s": seconds, "tokens_per_s": tokens / seconds, "wall_s": wall}


def window_run(data: Path, root: Path, seq_len: int, env: dict, train_rows: int, full_bytes: int) -> dict:
    """Capture (vLLM) and train at once over a window; the high-water mark of the shards on disk."""
    import threading

    settings = [f"data.train_files=[{data}]", f"data.seq_len={seq_len}", "target.dtype=float32"]
    settings += ["data.max_eval_rows=4", "train.grad_accum=2", "train.save_every=4", "train.eval_every=1000"]
    settings += [f"train.max_steps={train_rows // 2 - 2}", "data.feature_window=4"]
    row = seq_len * (9 + 6 * 256 * 4)  # ids/positions/mask + 5 layers and the teacher in float32
    settings += [f"capture.shard_bytes={4 * row + 4096}"]  # 4 rows per shard: 16 rows on disk at most
    folder = root / "window"

    def cmd(*extra):
        out = [sys.executable, "-m", "dflash_trainer.cli", *extra, "--config", "tiny-demo", "--no-progress"]
        for item in settings:
            out += ["--set", item]
        return out

    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                total = sum(p.stat().st_size for p in (folder / "shards").glob("train-*.safetensors"))
            except OSError:
                total = peak[0]
            peak[0] = max(peak[0], total)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    train = subprocess.Popen(
        cmd("train", "--set", f"data.features={folder}", "--set", f"output_dir={root / 'window-run'}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    capture = subprocess.run(
        cmd("capture", "--out", str(folder), "--engine", "vllm"), capture_output=True, text=True, env=env
    )
    _, err = train.communicate(timeout=3600)
    stop.set()
    if train.returncode or capture.returncode:
        raise SystemExit(f"window run failed: {err[-1500:]} {capture.stderr[-1500:]}")
    return {
        "window_shards": 4,
        "rows_per_shard": 4,
        "peak_bytes": peak[0],
        "full_cache_bytes": full_bytes,
        "peak_over_full": peak[0] / full_bytes,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=300, help="records cut from the tiny target's corpus")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    from external_venvs import vllm_python
    from test_train import write_data

    python = os.environ.get("DFLASH_VLLM_PYTHON") or str(vllm_python())
    env = {**os.environ, "DFLASH_VLLM_PYTHON": python, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        write_data(data, n=args.rows, chars=2000)
        for dtype in args.dtypes.split(","):
            row = {"dtype": dtype}
            for engine in ("transformers", "vllm"):
                row[engine] = capture(data, Path(tmp) / f"{engine}-{dtype}", args.seq_len, dtype, engine, env)
                print(dtype, engine, row[engine], flush=True)
            row["vllm_over_transformers"] = row["vllm"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
            results.append(row)
        full = json.loads((Path(tmp) / "transformers-float32" / "manifest.json").read_text())
        train_bytes = sum(r["bytes"] for n, r in full["shards"].items() if n.startswith("train-"))
        window = window_run(data, Path(tmp), args.seq_len, env, full["splits"]["train"], train_bytes)
        print("window", window, flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}"
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "baseline"
    report = {"machine": machine, "isa": isa, "seq_len": args.seq_len, "results": results, "window": window}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_capture.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Feature capture: in-process (transformers) vs vLLM, tiny target",
        "",
        f"Measured on {time.strftime('%Y-%m-%d')}: {machine} ({isa}); `python benchmarks/bench_vllm_capture.py "
        f"--rows {args.rows} --seq-len {args.seq_len} --dtypes {args.dtypes}`. Tokens/s of the capture itself "
        "(forward passes and shard writes; vLLM's engine start is in the wall time only).",
        "",
        "| dtype | rows x tokens | transformers tok/s | vLLM tok/s | vLLM / transformers | wall s (transformers, vLLM) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        t, v = r["transformers"], r["vllm"]
        lines.append(
            f"| {r['dtype']} | {t['rows']} x {args.seq_len} | {t['tokens_per_s']:,.0f} | {v['tokens_per_s']:,.0f} | "
            f"{r['vllm_over_transformers']:.2f}x | {t['wall_s']:.1f}, {v['wall_s']:.1f} |"
        )
    lines += [
        "",
        f"Bounded window (data.feature_window={window['window_shards']} shards of {window['rows_per_shard']} rows, "
        "vLLM capturing while the drafter trains, float32): at most "
        f"{window['peak_bytes'] / 1e6:,.1f} MB of training shards on disk, against {window['full_cache_bytes'] / 1e6:,.1f} MB "
        f"for the complete cache of the same rows ({window['peak_over_full']:.1%}); {window['wall_s']:.0f} s for "
        "capture and training together.",
    ]
    (RESULTS / "vllm_capture.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
