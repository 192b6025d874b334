"""The fused loss of two source trees side by side: forward + backward time of the same call, each tree in
its own process (both are ``dflash_trainer``), alternating rounds so that load drifts hit both alike.

    python benchmarks/bench_loss_versions.py --src OLD=/path/to/old/src --src NEW=src [--rounds 4]

A tree's loss API is whatever it has: ``LossTerms`` (the terms object) where ``dflash_trainer.loss``
exports it, else the keyword arguments of the old ``fused_draft_loss``. Inputs: fp32 and bf16,
N=4096, H=256, V=32000, chunk 128 rows, CE + 15% KL (T=1), the native kernel. Prints each round's
median per tree and the ratio of the medians over all rounds; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, time, torch
import dflash_trainer.loss as L
torch.manual_seed(0)
n, h, v, reps = 4096, 256, 32000, int(sys.argv[1])
out = {}
for dtype in (torch.float32, torch.bfloat16):
    hs = torch.randn(n, h).to(dtype).requires_grad_()
    ht = torch.randn(n, h).to(dtype)
    w = (torch.randn(v, h) * 0.05).to(dtype)
    y = torch.randint(0, v, (n,))
    wt = torch.ones(n, dtype=dtype)
    if hasattr(L, "LossTerms"):
        call = lambda: L.fused_draft_loss(hs, ht, w, y, wt, L.LossTerms(kl_weight=0.15), chunk_size=128, compile="native")
    else:
        call = lambda: L.fused_draft_loss(hs, ht, w, y, wt, kl_weight=0.15, chunk_size=128, compile="native")
    call()[0].backward()  # warm-up: the kernel is loaded here
    times = []
    for _ in range(reps):
        hs.grad = None
        t0 = time.perf_counter()
        call()[0].backward()
        times.append(time.perf_counter() - t0)
    out[str(dtype).removeprefix("torch.")] = times
print(json.dumps(out))
"""


def run(src: str, reps: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(reps)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", required=True, metavar="NAME=PATH", help="a tree's src folder; give two")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per round and dtype (default 3)")
    p.add_argument("--out", default=None, help="JSON file for the measured times")
    args = p.parse_args()
    trees = dict(s.split("=", 1) for s in args.src)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            for dtype, ts in run(trees[name], args.reps).items():
                times[name].setdefault(dtype, []).extend(ts)
                print(f"round {r + 1} {name:>8} {dtype:>8}: median {statistics.median(ts):.3f} s", flush=True)
    names = list(trees)
    for dtype in times[names[0]]:
        meds = {name: statistics.median(times[name][dtype]) for name in names}
        ratio = meds[names[1]] / meds[names[0]]
        print(
            f"{dtype}: "
            + ", ".join(f"{k} {m:.3f} s" for k, m in meds.items())
            + f"; {names[1]}/{names[0]} = {ratio:.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trees": trees, "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
