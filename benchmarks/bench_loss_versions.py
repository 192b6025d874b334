"""The fused loss of two source trees side by side: forward + backward time of the same call, each tree in
its own process (both are ``dflash_trainer``), alternating rounds so that load drifts hit both alike.

    python benchmarks/bench_loss_versions.py --src OLD=/path/to/old/src --src NEW=src [--rounds 4]
    python benchmarks/bench_loss_versions.py --step --src OLD=... --src NEW=src   # whole training steps

``--step``: a whole training step instead (target features, drafter forward, loss, backward, AdamW)
of each drafter variant, dflash, dspark and dflash2, on the tiny-demo layout with CE + 15% KL + CAP,
through the ``Trainer`` API both trees have (``benchmarks/bench_train_step.py``'s step).

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


STEP_WORKER = r"""
import json, sys, tempfile, time, torch
from pathlib import Path
from dflash_trainer.config import load_config
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.step import draft_loss, drafter_step, produce_row_features
from dflash_trainer.training.trainer import Trainer
reps, tmp = int(sys.argv[1]), Path(tempfile.mkdtemp())
data = tmp / "data.jsonl"
with data.open("w") as f:
    for doc in load_split("train", limit=24):
        f.write(json.dumps({"messages": [{"role": "user", "content": "Continue:"},
                                         {"role": "assistant", "content": doc.text[:1500]}]}) + "\n")
out = {}
settings = {"dspark": ["drafter.dspark.markov_rank=64"], "dflash2": ["drafter.dflash2.selector_rank=64"]}
for variant in ("dflash", "dspark", "dflash2"):
    cfg = load_config(["tiny-demo"], [f"data.train_files=[{data}]", f"output_dir={tmp / variant}",
                                      f"drafter.variant={variant}", "loss.kl_weight=0.15", "loss.cap_weight=0.1",
                                      *settings.get(variant, [])])
    target, tok, rows, eval_rows, _ = prepare(cfg)
    torch.manual_seed(0)
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp / variant, target_path="tiny", progress=False)
    times = []
    for rep in range(reps + 1):  # the first is the warm-up
        t0 = time.perf_counter()
        trainer.zero_grad()
        batch = drafter_step(trainer.drafter, produce_row_features(trainer.target, rows[rep % len(rows)], rep, cfg),
                             cfg, train=True)
        loss, _ = draft_loss(trainer.drafter, batch, cfg)
        loss.backward()
        trainer.optimizer_step()
        if rep:
            times.append(time.perf_counter() - t0)
    out[variant] = times
print(json.dumps(out))
"""


def run(src: str, reps: int, worker: str = WORKER) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(
        [sys.executable, "-c", worker, str(reps)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", required=True, metavar="NAME=PATH", help="a tree's src folder; give two")
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    p.add_argument("--reps", type=int, default=3, help="timed calls per round and dtype or variant (default 3)")
    p.add_argument("--step", action="store_true", help="whole training steps of each variant instead of the loss")
    p.add_argument("--out", default=None, help="JSON file for the measured times")
    args = p.parse_args()
    trees = dict(s.split("=", 1) for s in args.src)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            for dtype, ts in run(trees[name], args.reps, STEP_WORKER if args.step else WORKER).items():
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
