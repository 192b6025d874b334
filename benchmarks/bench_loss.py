"""Fused draft loss vs. the plain reference vs. Liger's chunked distillation loss, side by side.

    .venv/bin/python benchmarks/bench_loss.py            # writes benchmarks/results/loss.{json,md}
    .venv/bin/python benchmarks/bench_loss.py --quick    # first shape only
    .venv/bin/python benchmarks/bench_loss.py --topk     # top_k=16 vs 0 only: results/loss_topk.{json,md}

Every (variant, shape) runs in its own subprocess. Time is forward+backward, the median of the
timed repetitions after one warm-up. Peak extra memory comes from one more pass in which glibc
returns blocks over 1 MiB to the OS at once (``mallopt``), so that RSS follows the live tensors; a
thread samples RSS every 0.5 ms, and the peak is reported over the RSS before that pass (inputs,
libraries and warm-up caches excluded). At the seed scale there is only that one pass, timed too.
Inputs are fp32 on the CPU; the fused loss runs what
``compile="auto"`` picks there (the native kernel). The memory formula is the kernel's: ``dh`` ``[N, H]``
fp32 plus three fp32 ``[c, V]`` buffers (raw student and teacher logits, G), ``N*H*4 + c*V*12`` bytes.
Efficiency against the GEMM floor is ``--efficiency``'s (below). Loss terms: CE blended with 15% soft KL (T=1), the terms all three implement; the fused loss is
also run with CAP on (the ddtree-experiment terms).

The Markov head (``--markov`` alone, or as part of the full run): DSpark's loss as the dspark preset's
defaults use it on the tiny demo (CE with data labels, the Markov bias of rank 256 folded into the
head GEMM, the per-row acceptance the confidence head trains on, so the teacher's logits too), against
the same loss without the Markov head (CE + acceptance) and DFlash's (CE alone), at the tiny demo's
shape (N = 32 anchors x 8 = 256 rows, H = 256, V = 8,192) and at V = 151,936 (N = 4,096); each with
``compile="auto"`` (the native kernel) in its own process, as above.

DFlash2's candidates (``--topk``): the cost of ``top_k=16`` (each row's 16 best logits and ids, out of
the loss pass) in the native kernel at V = 151,936, fp32 and bf16, in ONE process, interleaved with
``top_k=0`` (order alternating each repetition): the kernel alone on one chunk of 128 raw-logit rows
(CE + 15% KL, with its gradient pass), the whole loss forward+backward (N = 512, 4 chunks), and for
comparison ``torch.topk`` over the same raw chunk (what the Triton path adds per chunk).

GEMM-floor efficiency (``--efficiency``, fp32 and bf16, first shape): in ONE process, the GEMM
floor and each implementation run interleaved, repeated, the order rotating each repetition. The
floor is the wall time of the three GEMMs any exact implementation must do, at the same chunk size
and dtype: per chunk of c rows ``[c,H]x[H,V]`` (student logits), ``[c,H]x[H,V]`` (teacher logits),
``[c,V]x[V,H]`` (dh = G W), by ``torch.mm`` into preallocated outputs. Efficiency = floor time /
implementation's forward+backward time, the median over repetitions of the per-repetition ratio
(the machine is shared; interleaving puts both under the same load).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(4096, 256, 32000), (4096, 256, 151_936), (24_576, 256, 248_320)]
CHUNK = 128  # rows per chunk for the fused loss and for Liger
TERMS = {"kl_weight": 0.15, "temperature": 1.0}  # LossTerms fields (loss_terms), also written to the results
# The fused loss's implementations of a chunk's element-wise work (fused_draft_loss's `compile`).
KERNELS = {"fused (native)": "native", "fused (eager)": False}
MARKOV_SHAPES = [(256, 256, 8192), (4096, 256, 151_936)]  # the tiny demo's loss (32 x 8 rows), and V = 151,936
MARKOV_RANK = 256  # drafter.dspark.markov_rank's default
# name -> DSpark's options as the loss sees them (CE with data labels, as the tiny demo's loss section):
# acceptance (DSpark's pair terms, the per-row acceptance and Renyi-1/2 at weight 0) and the Markov bias
MARKOV_VARIANTS = {
    "dflash (CE)": {},
    "dspark without Markov head (CE + acceptance)": {"acceptance": True},
    "dspark (CE + acceptance + Markov r=256)": {"acceptance": True, "bias": True},
}
MACHINE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_inputs(n: int, h: int, v: int):
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ht = torch.randn(n, h, generator=g)
    w_head = torch.randn(v, h, generator=g) * 0.05
    labels = torch.randint(0, v, (n,), generator=g)
    weights = torch.ones(n)
    return hs, ht, w_head, labels, weights


def loss_terms(base: dict = TERMS, acceptance: bool = False, **extra):
    """The loss's ``LossTerms``: the fields ``base`` (``TERMS`` by default) and ``extra``; with
    ``acceptance`` DSpark's pair terms (the acceptance and Renyi-1/2, metrics only)."""
    from dflash_trainer.loss import LossTerms, PairTerm

    if acceptance:
        extra["pair_terms"] = (PairTerm("accept", "overlap"), PairTerm("renyi", "renyi_half"))
    return LossTerms(**base, **extra)


def markov_inputs(n: int, v: int, r: int = MARKOV_RANK):
    """The Markov bias's trainable inputs: features ``[N, r]`` (``W1[prev]``) and ``W2`` ``[V, r]``."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, r, generator=g) * 0.05).requires_grad_(), (
        torch.randn(v, r, generator=g) * 0.05
    ).requires_grad_()


def loss_step(variant: str, hs, ht, w_head, labels, weights):
    """One forward+backward of ``variant`` on these inputs: "fused" (``compile="auto"``), "fused+cap",
    a ``KERNELS`` name, "reference", "liger" or a ``MARKOV_VARIANTS`` name (the caller clears the grads)."""
    if variant in MARKOV_VARIANTS:
        from dflash_trainer.loss import fused_draft_loss

        kw, options = {}, MARKOV_VARIANTS[variant]
        if options.get("bias"):
            kw["bias_rows"], kw["bias_weight"] = markov_inputs(hs.shape[0], w_head.shape[0])
        terms = loss_terms({}, options.get("acceptance", False))  # CE with data labels
        teacher = ht if terms.needs_teacher else None  # DFlash's CE needs no teacher states

        def step():
            loss, _ = fused_draft_loss(hs, teacher, w_head, labels, weights, terms, chunk_size=CHUNK, **kw)
            loss.backward()
            for x in (kw.get("bias_rows"), kw.get("bias_weight")):
                if x is not None:
                    x.grad = None
    elif variant.startswith("fused"):
        from dflash_trainer.loss import fused_draft_loss

        terms = loss_terms(cap_weight=0.1) if variant == "fused+cap" else loss_terms()
        compile = KERNELS.get(variant, "auto")

        def step():
            loss, _ = fused_draft_loss(hs, ht, w_head, labels, weights, terms, chunk_size=CHUNK, compile=compile)
            loss.backward()
    elif variant == "reference":
        from dflash_trainer.loss import reference_draft_loss

        terms = loss_terms()

        def step():
            loss, _ = reference_draft_loss(hs, ht, w_head, labels, weights, terms)
            loss.backward()
    elif variant == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        # beta=0: forward KL(teacher || student); hard/soft weights = our (1-a) CE + a KL.
        fn = LigerFusedLinearJSDLoss(
            weight_hard_loss=1 - TERMS["kl_weight"],
            weight_soft_loss=TERMS["kl_weight"],
            beta=0.0,
            temperature=TERMS["temperature"],
            compiled=False,
            chunk_size=CHUNK,
        )

        def step():
            fn(hs, w_head, ht, w_head, labels).backward()
    else:
        raise ValueError(variant)
    return step


def worker(variant: str, n: int, h: int, v: int, reps: int) -> dict:
    """Runs in a fresh process: time and peak extra memory of one variant at one shape."""
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    hs, ht, w_head, labels, weights = make_inputs(n, h, v)
    step = loss_step(variant, hs, ht, w_head, labels, weights)
    times = []
    for i in range(reps + 1 if reps else 0):
        hs.grad = None
        t0 = time.perf_counter()
        step()
        if i:  # the first run is the warm-up
            times.append(time.perf_counter() - t0)
    # Memory pass: glibc returns blocks over 1 MiB to the OS at once from now on, so RSS follows the
    # live tensors; a sampling thread records the peak over the base taken after the warm-up.
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    hs.grad = None
    gc.collect()
    libc.malloc_trim(0)
    base = rss_bytes()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    step()
    memory_pass_s = time.perf_counter() - t0
    done.set()
    sampler.join()
    result = {"peak_extra_bytes": max(0, peak[0] - base), "reps": reps}
    if times:
        result["time_s"] = statistics.median(times)
    else:  # seed scale: one pass only, timed while memory is measured
        result["time_s"], result["timed_in_memory_pass"] = memory_pass_s, True
    return result


def markov_formula(n: int, h: int, v: int, bias: bool) -> int:
    """Bytes the fused loss keeps beyond its inputs with the native kernel: ``dh`` and the three
    ``[c, V]`` buffers, plus with the Markov head its gradients ``d f`` ``[N, r]`` and ``d W2`` ``[V, r]``
    (fp32) and their copies as the backward hands them out."""
    return n * h * 4 + CHUNK * v * 12 + (2 * (n + v) * MARKOV_RANK * 4 if bias else 0)


def run_markov() -> list[dict]:
    rows = []
    for n, h, v in MARKOV_SHAPES:
        reps = 20 if n * v < 10**7 else 3
        for variant, kw in MARKOV_VARIANTS.items():
            row = {"N": n, "H": h, "V": v, "r": MARKOV_RANK if kw.get("bias") else 0, "variant": variant}
            row["formula_bytes"] = markov_formula(n, h, v, kw.get("bias", False))
            print(f"N={n} H={h} V={v} {variant} ...", flush=True)
            row.update(run_worker(variant, n, h, v, reps, timeout=1800))
            rows.append(row)
            print("   ", {k: row[k] for k in row if k not in ("N", "H", "V")}, flush=True)
    return rows


def markov_markdown(rows: list[dict]) -> list[str]:
    lines = [
        "",
        f"## DSpark's Markov head in the loss (rank {MARKOV_RANK})",
        "",
        "CE with data labels (the tiny demo's loss terms), chunk "
        f'{CHUNK} rows, fp32, `compile="auto"` (the native kernel, with the per-row acceptance in its row '
        "pass). Formula: N*H*4 + c*V*12, plus 2*(N + V)*r*4 with the head (d f, d W2 and their copies).",
        "",
        "| N | H | V | variant | fwd+bwd s | peak extra MB | formula MB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = f"{r['time_s']:.4f}" if "time_s" in r else "-"
        mem = f"{r['peak_extra_bytes'] / 2**20:.1f}" if "peak_extra_bytes" in r else "-"
        lines.append(
            f"| {r['N']} | {r['H']} | {r['V']} | {r['variant']} | {t} | {mem} | "
            f"{r['formula_bytes'] / 2**20:.1f} | {r.get('skipped', '')} |"
        )
    lines += ["", "With vs without the Markov head (same shape, same terms otherwise):", ""]
    names = list(MARKOV_VARIANTS)
    for n, h, v in sorted({(r["N"], r["H"], r["V"]) for r in rows}, key=lambda x: x[0] * x[2]):
        by = {r["variant"]: r for r in rows if (r["N"], r["H"], r["V"]) == (n, h, v)}
        plain, no_head, head = (by.get(name, {}) for name in names)
        if "time_s" not in head or "time_s" not in no_head:
            continue
        part = (
            f"- N={n} V={v}: the head costs {head['time_s'] / no_head['time_s']:.2f}x the time and "
            f"{head['peak_extra_bytes'] / max(no_head['peak_extra_bytes'], 1):.2f}x the peak extra memory of "
            f"the loss without it ({head['time_s']:.4f} vs {no_head['time_s']:.4f} s, "
            f"{head['peak_extra_bytes'] / 2**20:.1f} vs {no_head['peak_extra_bytes'] / 2**20:.1f} MB)"
        )
        if "time_s" in plain:
            part += (
                f"; DSpark's loss against DFlash's CE: {head['time_s'] / plain['time_s']:.2f}x the time, "
                f"{head['peak_extra_bytes'] / max(plain['peak_extra_bytes'], 1):.2f}x the memory"
            )
        lines.append(part + ".")
    return lines


def run_worker(variant: str, n: int, h: int, v: int, reps: int, timeout: int) -> dict:
    env = dict(os.environ)
    cmd = [sys.executable, __file__, "--worker", variant, str(n), str(h), str(v), str(reps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"did not finish within {timeout} s"}
    if out.returncode != 0:
        return {"skipped": f"failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def efficiency_rows(dtype: torch.dtype, n: int, h: int, v: int, threads: int, reps: int, variants) -> list[dict]:
    """Floor and implementations interleaved in this process; one row per implementation."""
    from dflash_trainer.loss import native

    torch.set_num_threads(threads)
    hs, ht, w_head, labels, weights = (x.to(dtype) if x.is_floating_point() else x for x in make_inputs(n, h, v))
    hs = hs.detach().requires_grad_()
    x_c, z_c, dh_c = (
        torch.randn(CHUNK, h, dtype=dtype),
        torch.empty(CHUNK, v, dtype=dtype),
        torch.empty(CHUNK, h, dtype=dtype),
    )

    def floor():
        for _ in range(0, n, CHUNK):
            torch.mm(x_c, w_head.T, out=z_c)  # student logits
            torch.mm(x_c, w_head.T, out=z_c)  # teacher logits
            torch.mm(z_c, w_head, out=dh_c)  # dh = G @ W

    def make(variant):
        step = loss_step(variant, hs, ht, w_head, labels, weights)

        def timed():
            hs.grad = None
            step()

        return timed

    runs = {"floor": floor, **{name: make(name) for name in variants}}
    native.reset()  # so that the native kernel's first call says whether it was built or read from the cache
    warmup = {}
    for name, fn in runs.items():  # warm-up; the native kernel is built (or read from its cache) here
        t0 = time.perf_counter()
        fn()
        warmup[name] = time.perf_counter() - t0
    times = {name: [] for name in runs}
    names = list(runs)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name in variants:
        ratios = [f / t for f, t in zip(times["floor"], times[name])]
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "threads": threads,
            "N": n,
            "H": h,
            "V": v,
            "variant": name,
            "floor_s": statistics.median(times["floor"]),
            "time_s": statistics.median(times[name]),
            "efficiency": statistics.median(ratios),
            "efficiency_min_max": [min(ratios), max(ratios)],
            "reps": reps,
            "floor_gflops": 6 * n * h * v / statistics.median(times["floor"]) / 1e9,
        }
        if name == "fused (native)":
            row["compile_s"] = native.BUILD_SECONDS or 0.0  # 0: the library came from the disk cache
            row["first_call_s"] = warmup[name]
        rows.append(row)
        print("   ", row, flush=True)
    return rows


TOPK = 16  # DFlash2's candidates per row (its default K)
TOPK_SHAPE = (512, 256, 151_936)  # N, H, V of the loss rows; the kernel rows are one chunk of CHUNK
TOPK_CALLS = 10  # kernel calls on the chunk per timed repetition (times are reported per call)


def topk_rows(dtype: torch.dtype, reps: int) -> list[dict]:
    """``top_k`` 0 vs TOPK, interleaved in this process: the native kernel on one chunk, the loss, torch.topk."""
    from dflash_trainer.loss import fused_draft_loss, native

    terms = {k: loss_terms(top_k=k) for k in (0, TOPK)}
    n, h, v = TOPK_SHAPE
    hs, ht, w_head, labels, weights = (x.to(dtype) if x.is_floating_point() else x for x in make_inputs(n, h, v))
    hs = hs.detach().requires_grad_()
    zs, zt = hs.detach()[:CHUNK] @ w_head.T, ht[:CHUNK] @ w_head.T  # [c, V] raw logits, head dtype
    y, coef, g_out = labels[:CHUNK], torch.full((CHUNK,), 1.0 / n), torch.empty_like(zs)

    def kernel(k):
        def calls():  # TOPK_CALLS calls per timing: the clock's CPU time moves in scheduler ticks (4 ms here)
            for _ in range(TOPK_CALLS):
                native.chunk_epilogue(zs, zt, y, coef, g_out, terms[k])

        return calls

    def kernel_then_topk():
        for _ in range(TOPK_CALLS):
            native.chunk_epilogue(zs, zt, y, coef, g_out, terms[0])
            torch.topk(zs, TOPK)

    def loss(k):
        def step():
            hs.grad = None
            out, _ = fused_draft_loss(hs, ht, w_head, labels, weights, terms[k], chunk_size=CHUNK, compile="native")
            out.backward()

        return step

    pairs = {
        f"native kernel, one chunk [{CHUNK}, V]": (kernel(0), kernel(TOPK)),
        f"loss fwd+bwd, N={n} (native)": (loss(0), loss(TOPK)),
        # what a Triton chunk adds: its kernel, then torch.topk over the raw chunk
        f"kernel then torch.topk on the chunk [{CHUNK}, V]": (kernel(0), kernel_then_topk),
    }
    rows = []
    for name, (base, with_k) in pairs.items():
        base(), with_k()  # warm-up (the kernel builds on the first call)
        times, cpu = {"base": [], "topk": []}, {"base": [], "topk": []}
        for rep in range(reps):
            for key in ("base", "topk") if rep % 2 == 0 else ("topk", "base"):
                t0, c0 = time.perf_counter(), time.process_time()
                (base if key == "base" else with_k)()
                times[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
        per = TOPK_CALLS if name.startswith(("native kernel", "kernel then")) else 1
        times = {key: [x / per for x in xs] for key, xs in times.items()}
        cpu = {key: [x / per for x in xs] for key, xs in cpu.items()}
        ratios = [t / b for b, t in zip(times["base"], times["topk"])]
        cpu_ratios = [t / b for b, t in zip(cpu["base"], cpu["topk"])]
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "case": name,
            "top_k": TOPK,
            "base_s": statistics.median(times["base"]),
            "topk_s": statistics.median(times["topk"]),
            "ratio": statistics.median(ratios),
            "ratio_min_max": [min(ratios), max(ratios)],
            "ratio_of_fastest": min(times["topk"]) / min(times["base"]),  # the least loaded repetitions
            # CPU time of the process (all threads): what the work costs, less exposed to other users' load
            "cpu_base_s": statistics.median(cpu["base"]),
            "cpu_topk_s": statistics.median(cpu["topk"]),
            "cpu_ratio": statistics.median(cpu_ratios),
            "reps": reps,
        }
        rows.append(row)
        print("   ", row, flush=True)
    return rows


def run_topk(reps: int) -> None:
    torch.set_num_threads(2)
    load_before = os.getloadavg()[0]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        print(f"topk {dtype} ...", flush=True)
        rows += topk_rows(dtype, reps)
    n, h, v = TOPK_SHAPE
    meta = {
        "cpus": os.cpu_count(),
        "threads": 2,
        "torch": torch.__version__,
        "chunk": CHUNK,
        "terms": TERMS,
        "N": n,
        "H": h,
        "V": v,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "command": f"python benchmarks/bench_loss.py --topk --reps {reps}",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loss_topk.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / "loss_topk.md").write_text(topk_markdown(rows, meta))
    print(topk_markdown(rows, meta))


def topk_markdown(rows: list[dict], meta: dict) -> str:
    lo, hi = meta["load_average_1min"]
    lines = [
        f"# DFlash2's top-{TOPK} candidates in the fused loss ({meta['date']}, {meta['cpus']} CPUs, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; V={meta['V']}, H={meta['H']}, chunk {meta['chunk']} rows, CE + 15% KL (T=1), "
        f"{meta['threads']} threads; top_k={TOPK} against top_k=0 interleaved in one process, the median of the "
        f"per-repetition ratios, the ratio of the fastest repetitions (the least disturbed), and the same on the process's CPU time (all threads; less exposed to other users of the machine than wall time). Load average (1 min) before / after: {lo:.1f} / {hi:.1f} on {meta['cpus']} CPUs "
        "(a shared machine).",
        "",
        f"Kernel rows: times per call, timed {TOPK_CALLS} calls at a time.",
        "",
        "| dtype | case | top_k=0 s | with top_k s | ratio (median) | min-max | fastest / fastest | CPU s: top_k=0 / with | CPU ratio (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["ratio_min_max"]
        lines.append(
            f"| {r['dtype']} | {r['case']} | {r['base_s']:.4f} | {r['topk_s']:.4f} | {r['ratio']:.3f} | {a:.3f}-{b:.3f} "
            f"| {r['ratio_of_fastest']:.3f} | {r['cpu_base_s']:.4f} / {r['cpu_topk_s']:.4f} | {r['cpu_ratio']:.3f} |"
        )
    lines += [
        "",
        "The last row of each dtype is the native kernel without its selection followed by torch.topk over the "
        "raw chunk, what the Triton path does (measured here on the CPU, as a scale: on a GPU "
        "costs differ).",
    ]
    return "\n".join(lines) + "\n"


def run_efficiency(threads_list: list[int], reps: int, variants: list[str]) -> None:
    n, h, v = SHAPES[0]
    rows = []
    if "liger" in variants:
        try:
            import liger_kernel.chunked_loss  # noqa: F401
        except ImportError:
            print("liger: liger-kernel is not installed (pip install -e '.[bench]'); its rows are skipped")
            variants = [name for name in variants if name != "liger"]
    for threads in threads_list:
        for dtype in (torch.float32, torch.bfloat16):
            print(f"efficiency {dtype} threads={threads} ...", flush=True)
            rows += efficiency_rows(dtype, n, h, v, threads, reps, variants)
    meta = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "chunk": CHUNK,
        "terms": TERMS,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1min_at_end": os.getloadavg()[0],
        "command": "python benchmarks/bench_loss.py --efficiency --threads "
        + " ".join(map(str, threads_list))
        + f" --reps {reps}",
        "definition": (
            "efficiency = floor / fwd+bwd time, median over repetitions of the per-repetition ratio; floor = "
            "wall time of the three GEMMs per chunk of c rows that any exact implementation does ([c,H]x[H,V] "
            "student logits, [c,H]x[H,V] teacher logits, [c,V]x[V,H] dh = G W) by torch.mm into preallocated "
            "outputs, same dtype, chunk and threads, in the same process, interleaved with the implementation "
            "(order rotating each repetition)"
        ),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loss_efficiency.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / "loss_efficiency.md").write_text(efficiency_markdown(rows, meta))
    print(efficiency_markdown(rows, meta))


def efficiency_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Draft loss at its GEMM floor ({meta['date']}, {meta['cpus']} CPUs, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; N={rows[0]['N']} H={rows[0]['H']} V={rows[0]['V']}, chunk {meta['chunk']} rows, "
        f"CE + 15% KL (T=1), forward + backward. Load average (1 min) at the end: "
        f"{meta['load_average_1min_at_end']:.1f} on {meta['cpus']} CPUs.",
        "",
        f"Definition: {meta['definition']}.",
        "",
        "| dtype | threads | variant | floor s | fwd+bwd s | efficiency (median) | min-max over reps | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comp = f"{r['compile_s']:.1f}" if "compile_s" in r else ""
        lo, hi = r["efficiency_min_max"]
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['variant']} | {r['floor_s']:.3f} | {r['time_s']:.3f} | "
            f"{r['efficiency']:.0%} | {lo:.0%}-{hi:.0%} | {comp} |"
        )
    lines += ["", "Targets (issue 18): fused >= 85% in fp32 and >= 70% in bf16."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=5, metavar=("VARIANT", "N", "H", "V", "REPS"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--render", action="store_true", help="only re-render results/loss.md from results/loss.json")
    parser.add_argument("--efficiency", action="store_true", help="only the GEMM-floor efficiency (fp32 and bf16)")
    parser.add_argument("--markov", action="store_true", help="only the Markov-head cases (results/loss_markov.*)")
    parser.add_argument("--topk", action="store_true", help="only top_k=16 vs 0 (results/loss_topk.*)")
    parser.add_argument("--threads", type=int, nargs="+", default=[2], help="thread counts for --efficiency")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (--efficiency: 5, --topk: 11)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[*KERNELS, "reference", "liger"],
        help="implementations for --efficiency",
    )
    args = parser.parse_args()
    if args.efficiency:
        run_efficiency(args.threads, args.reps or 5, args.variants)
        return
    if args.topk:
        run_topk(args.reps or 11)
        return
    if args.render:
        render(RESULTS / "loss.json")
        return
    if args.worker:
        variant, n, h, v, reps = args.worker
        print(json.dumps(worker(variant, int(n), int(h), int(v), int(reps))))
        return
    if args.markov:
        torch.set_num_threads(2)
        markov_rows = run_markov()
        meta = {"cpus": os.cpu_count(), "threads": 2, "torch": torch.__version__, "chunk": CHUNK}
        meta["date"], meta["command"] = time.strftime("%Y-%m-%d"), "python benchmarks/bench_loss.py --markov"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "loss_markov.json").write_text(json.dumps({"meta": meta, "rows": markov_rows}, indent=2) + "\n")
        text = f"# Markov head in the draft loss ({meta['date']}, `{meta['command']}`)\n" + "\n".join(
            markov_markdown(markov_rows)
        )
        (RESULTS / "loss_markov.md").write_text(text + "\n")
        print(text)
        return

    torch.set_num_threads(2)
    rows = []
    ref_bytes_per_logit = None  # measured reference peak / (N*V), used to predict where it cannot run
    for n, h, v in SHAPES[:1] if args.quick else SHAPES:
        big = n * v > 50_000_000
        reps = 0 if n * v > 10**9 else (2 if big else 3)
        formula = n * h * 4 + CHUNK * v * 12
        for variant in ("fused", "fused+cap", "reference", "liger"):
            row = {"N": n, "H": h, "V": v, "variant": variant, "formula_bytes": formula}
            if variant == "reference" and ref_bytes_per_logit is not None:
                predicted = ref_bytes_per_logit * n * v
                row["predicted_peak_bytes"] = predicted
                if predicted > 0.7 * MACHINE_BYTES:
                    row["skipped"] = (
                        f"predicted peak {predicted / 1e9:.1f} GB ({ref_bytes_per_logit:.1f} bytes per "
                        f"logit, measured at the first shape) exceeds 70% of this machine's "
                        f"{MACHINE_BYTES / 1e9:.1f} GB; one fp32 [N, V] tensor alone is {n * v * 4 / 1e9:.1f} GB"
                    )
            if "skipped" not in row:
                print(f"N={n} H={h} V={v} {variant} ...", flush=True)
                row.update(run_worker(variant, n, h, v, reps, timeout=1800))
            if "time_s" in row and variant == "reference" and ref_bytes_per_logit is None:
                ref_bytes_per_logit = row["peak_extra_bytes"] / (n * v)
            rows.append(row)
            print("   ", {k: row[k] for k in row if k not in ("N", "H", "V")}, flush=True)
    markov_rows = [] if args.quick else run_markov()

    RESULTS.mkdir(exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": 2,
        "torch": torch.__version__,
        "chunk": CHUNK,
        "terms": TERMS,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/bench_loss.py" + (" --quick" if args.quick else ""),
    }
    data = {"meta": meta, "rows": rows, "markov_rows": markov_rows}
    (RESULTS / "loss.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / "loss.md").write_text(markdown(rows, meta, markov_rows))
    print(markdown(rows, meta, markov_rows))


def markdown(rows: list[dict], meta: dict, markov_rows: list[dict] = ()) -> str:
    lines = [
        f"# Draft loss benchmark ({meta['date']}, {meta['cpus']} CPUs, {meta['threads']} threads, torch {meta['torch']})",
        "",
        f"`{meta['command']}`; fp32, chunk {meta['chunk']} rows, CE + 15% KL (T=1), `fused+cap` adds CAP 0.1; "
        "the fused loss with its native CPU kernel. Formula: N*H*4 + c*V*12 bytes (dh and the kernel's three "
        "[c, V] buffers). Efficiency against the GEMM floor: `loss_efficiency.md`.",
        "",
        "| N | H | V | variant | fwd+bwd s | peak extra MB | formula MB | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = f"{r['time_s']:.3f}" if "time_s" in r else "-"
        mem = f"{r['peak_extra_bytes'] / 2**20:.0f}" if "peak_extra_bytes" in r else "-"
        lines.append(
            f"| {r['N']} | {r['H']} | {r['V']} | {r['variant']} | {t} | {mem} | "
            f"{r['formula_bytes'] / 2**20:.0f} | {r.get('skipped', '')} |"
        )
    lines += ["", "Ratios measured in this run (targets from the issue in brackets):", ""]
    for n, h, v in sorted({(r["N"], r["H"], r["V"]) for r in rows}, key=lambda x: x[0] * x[2]):
        by = {r["variant"]: r for r in rows if (r["N"], r["H"], r["V"]) == (n, h, v)}
        fused = by.get("fused", {})
        if "time_s" not in fused:
            continue
        parts = [
            f"- N={n} V={v}: fused peak extra {fused['peak_extra_bytes'] / fused['formula_bytes']:.2f}x the "
            f"formula N*H*4 + c*V*12 [<= 1.2x]"
        ]
        for other in ("reference", "liger"):
            o = by.get(other, {})
            if "time_s" in o:
                parts.append(
                    f"{fused_speed(fused, o)} faster than {other} [>= 1.5x at the first shape], "
                    f"{o['peak_extra_bytes'] / max(fused['peak_extra_bytes'], 1):.1f}x less memory"
                )
            elif "predicted_peak_bytes" in o:
                parts.append(
                    f"{o['predicted_peak_bytes'] / max(fused['peak_extra_bytes'], 1):.0f}x less memory than "
                    f"the {other}'s predicted peak [>= 10x at the second shape]"
                )
        lines.append("; ".join(parts) + ".")
    if markov_rows:
        lines += markov_markdown(markov_rows)
    return "\n".join(lines) + "\n"


def fused_speed(fused: dict, other: dict) -> str:
    return f"{other['time_s'] / fused['time_s']:.2f}x"


def render(path: Path) -> None:
    """Rewrite the Markdown table from a results JSON (no measurement)."""
    data = json.loads(path.read_text())
    (path.with_suffix(".md")).write_text(markdown(data["rows"], data["meta"], data.get("markov_rows", [])))


if __name__ == "__main__":
    main()
