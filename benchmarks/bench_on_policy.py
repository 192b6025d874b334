"""The on-policy stage against more SFT at equal compute, on the embedded tiny target and the demo's data.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_on_policy.py [--seeds 0 1] [--steps 800] [--on-policy 100]
    # writes benchmarks/results/on_policy.{json,md}

Per seed, the arms of ``ARMS`` below, from the demo's regenerated data (the tiny-demo preset in fp32,
its default recipe): ``sft`` trains S SFT steps; every other arm starts from the same S - k step SFT
checkpoint (``sft-start`` scores it as it is) and trains k more steps: SFT again (``sft-restart*``, the
control) or on-policy (``op-*``: ``train --stage on-policy`` with the text or verified teacher, greedy
(T0) or T = 1 rollouts, chain or DDTree-16 (``op-tree``), at the preset's or a fine-tune's rate).

Compute is counted in target tokens (the tiny target's forward passes dominate a step's cost beside the
drafter's): an SFT step runs the target over its packed row (``data.seq_len`` tokens); an on-policy step
runs it over the rollout (prompt prefill, one verification pass of B tokens per round, replays) and
once more over the rollout's text for the drafter's context rows. The table gives every arm's total.

Scored on the same held-out rows as the demo (``score``): teacher-forced chain and DDTree-16 tau,
decode-path tau (equal to real greedy decoding round for round), served tau (real speculative decoding
of the first 8 held-out prompts, 64 tokens, as ``speculate`` runs it: chain and DDTree-16, greedy and
sampled at T = 1), and chain tau at T = 1 expected along the rows. Served through vLLM is not part of
this benchmark (docs/on-policy.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from demo_bench import demo_data, kept_and_slot_lines, kept_runs, results_header, train_on_demo_data

RESULTS = Path(__file__).resolve().parent / "results"
# arm -> the settings of its k steps from the S - k SFT checkpoint ("sft" trains S steps from scratch).
# "sft-restart" is the control: k more SFT steps from the same checkpoint, so the on-policy arms' restart
# of the schedule (warmup to the peak rate again, then decay) is not mistaken for the stage's effect.
ON_POLICY = ["train.stage=on_policy"]
ARMS = {
    "sft": None,
    "sft-start": None,  # the S - k step checkpoint every continuation starts from, scored as it is
    "sft-restart": ["train.stage=sft"],
    "op-text-T0": [*ON_POLICY, "on_policy.teacher=text", "on_policy.temperature=0.0"],
    "op-text-T1": [*ON_POLICY, "on_policy.teacher=text", "on_policy.temperature=1.0"],
    "op-verified-T0": [*ON_POLICY, "on_policy.teacher=verified", "on_policy.temperature=0.0"],
    "op-verified-T1": [*ON_POLICY, "on_policy.teacher=verified", "on_policy.temperature=1.0"],
    # the continuation at a tenth of the preset's learning rate (a fine-tune's)
    "sft-restart-lr1e-4": ["train.stage=sft", "train.lr=1e-4"],
    "op-text-T0-lr1e-4": [*ON_POLICY, "on_policy.teacher=text", "on_policy.temperature=0.0", "train.lr=1e-4"],
    # DDTree rollouts (budget 16, the accepted path as signal) against the chain's, same settings otherwise
    "op-tree-T0-lr1e-4": [
        *ON_POLICY,
        "on_policy.rollout=ddtree",
        "on_policy.budget=16",
        "on_policy.temperature=0.0",
        "train.lr=1e-4",
    ],  # fmt: skip
}


# the table's acceptance columns, in order (``score``'s keys)
SCORES = (
    "tau",
    "ddtree16_tau",
    "decode_tau",
    "served_chain_t0",
    "served_ddtree16_t0",
    "t1_expected",
    "t1_measured",
    "t1_ddtree16_measured",
)


def score(target, drafter, rows, eos) -> dict:
    """Held-out acceptance every way the issue asks: teacher-forced (chain, DDTree-16), the decode path
    (real greedy decoding round for round), served (real speculative decoding of the first 8 held-out
    prompts, 64 tokens, chain and DDTree-16: what ``speculate`` runs) at T = 0 and T = 1, and chain tau
    at T = 1 expected along the rows."""
    from dflash_trainer.inference.acceptance import acceptance_report
    from dflash_trainer.inference.sampled_acceptance import document_prompts, sampled_report
    from dflash_trainer.inference.speculative import SpeculativeDecoder

    rep = acceptance_report(target, drafter, rows, budgets=[16], decode_path=True)
    t1 = sampled_report(target, drafter, rows, eos, temperature=1.0, budgets=[16], max_new_tokens=64)
    decoder, served = SpeculativeDecoder(target, drafter, eos), {}
    for mode in ("chain", "ddtree"):
        accepted = []
        for prompt in document_prompts(rows, 8):
            accepted += decoder.generate(prompt, 64, mode, budget=16).accepted
        served[mode] = sum(a + 1 for a in accepted) / len(accepted)
    return {
        "tau": rep["tau"],
        "decode_tau": rep["decode_tau"],
        "ddtree16_tau": rep["ddtree_tau"][0],
        "served_chain_t0": served["chain"],
        "served_ddtree16_t0": served["ddtree"],
        "t1_expected": t1["expected"]["tau"],
        "t1_measured": t1["measured"]["chain"]["tau"],
        "t1_stderr": t1["measured"]["chain"]["stderr"],
        "t1_ddtree16_measured": t1["measured"]["ddtree"][0]["tau"],
        "slot_acceptance": rep["slot_acceptance"],
    }


def trained(root: Path, out: Path, settings: list[str], steps: int):
    """``train_on_demo_data``'s ``(cfg, target, trainer or None, rows, seconds, drafter)``: a run already
    trained into ``out`` by an earlier invocation (its last checkpoint complete) is loaded, not retrained."""
    ckpt = out / "checkpoints" / f"step-{steps:07d}"
    if not (ckpt / "trainer_state.pt").is_file():
        cfg, target, trainer, rows, seconds = train_on_demo_data(root, out, settings)
        return cfg, target, trainer.tokenizer, rows, seconds, trainer.drafter
    from dflash_trainer.config import load_config
    from dflash_trainer.drafter_folder import load_drafter
    from dflash_trainer.training.setup import prepare

    data = [f"data.train_files=[{root / 'data' / 'train.jsonl'}]", f"data.eval_files=[{root / 'data' / 'eval.jsonl'}]"]
    cfg = load_config(["tiny-demo"], [*data, f"output_dir={out}", *settings])
    target, tok, _, eval_rows, _ = prepare(cfg)
    drafter, _ = load_drafter(ckpt, target)
    seconds = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["elapsed_s"]  # its training loop
    return cfg, target, tok, eval_rows[: cfg.data.max_eval_rows], seconds, drafter.eval()


def run_seed(root: Path, seed: int, steps: int, k: int, arms: list[str]) -> list[dict]:
    """The arms of one seed, in this process; their result rows."""
    import torch

    from dflash_trainer.inference.regenerate import eos_ids

    base = [f"train.seed={seed}", "train.dtype=float32"]
    out = []
    t0 = time.time()
    if "sft" in arms:
        cfg, target, tok, rows, seconds, drafter = trained(
            root, root / f"sft-s{seed}", [*base, f"train.max_steps={steps}"], steps
        )
        eos = eos_ids(target.model, tok)
        out.append({"arm": "sft", "seed": seed, "train_seconds": round(seconds, 1),
                    "target_tokens": steps * cfg.data.seq_len, **score(target, drafter, rows, eos)})  # fmt: skip
    sft_k = root / f"sft{steps - k}-s{seed}"
    cfg, target, tok, rows, seconds_sft, drafter = trained(
        root, sft_k, [*base, f"train.max_steps={steps - k}"], steps - k
    )
    if "sft-start" in arms:
        out.append({"arm": "sft-start", "seed": seed, "train_seconds": round(seconds_sft, 1),
                    "target_tokens": (steps - k) * cfg.data.seq_len,
                    **score(target, drafter, rows, eos_ids(target.model, tok))})  # fmt: skip
    ckpt = sft_k / "checkpoints" / f"step-{steps - k:07d}"
    for arm in arms:
        if ARMS[arm] is None:
            continue
        settings = [*base, *ARMS[arm], f"train.max_steps={k}", f"drafter.init_from={ckpt}"]
        settings += [f"train.save_every={k}", f"train.eval_every={k}"]
        _, target, trainer, rows, seconds = train_on_demo_data(root, root / f"{arm}-s{seed}", settings)
        # the target's tokens for the rollouts and for the pass over each rollout's text (trainer counters;
        # an SFT step's target pass is one row)
        rollout_tokens, feature_tokens = trainer.c.rollout_target_tokens, trainer.c.rollout_feature_tokens
        if arm.startswith("sft-restart"):
            feature_tokens = k * cfg.data.seq_len
        eos = eos_ids(target.model, trainer.tokenizer)
        out.append({
            "arm": arm, "seed": seed, "train_seconds": round(seconds_sft + seconds, 1),
            "target_tokens": (steps - k) * cfg.data.seq_len + rollout_tokens + feature_tokens,
            "rollout_target_tokens": rollout_tokens, "feature_tokens": feature_tokens,
            **score(target, trainer.drafter, rows, eos),
        })  # fmt: skip
    for r in out:
        r["torch_threads"] = torch.get_num_threads()
    print(f"seed {seed}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def mean(xs):
    return sum(xs) / len(xs)


def write_results(args, root: Path, runs: list, t0: float) -> None:
    cmd = "PYTHONPATH=src .venv/bin/python benchmarks/bench_on_policy.py --seeds " + " ".join(map(str, args.seeds))
    cmd += f" --steps {args.steps} --on-policy {args.on_policy}"
    cmd += f" --arms {' '.join(args.arms)}" if args.arms != list(ARMS) else ""
    info = {**results_header(root, cmd, t0), "steps": args.steps, "on_policy_steps": args.on_policy, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "on_policy.json").write_text(json.dumps(info, indent=1) + "\n")
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    lines = [
        "# The on-policy stage against more SFT (tiny target, demo data, equal compute)",
        "",
        f"`{cmd}` ({info['date']}, {info['machine']}, {info['total_seconds']} s).",
        f"Same regenerated data ({info['records']['train']} training / {info['records']['eval']} held-out records), "
        f"the tiny-demo preset in fp32 with its default recipe. `sft`: {args.steps} SFT steps. `sft-start`: "
        f"{args.steps - args.on_policy} SFT steps (where the arms below start). `sft-restart`: "
        f"{args.steps - args.on_policy} SFT steps, then {args.on_policy} more SFT steps from that checkpoint (a new "
        "warmup and decay: the on-policy arms' schedule). `op-TEACHER-T`: the same checkpoint, then "
        f"{args.on_policy} on-policy steps "
        "(`train --stage on-policy`, 64 new tokens per rollout) with greedy (T0) or T = 1 (T1) rollouts and "
        "`on_policy.teacher` text (the target's states along the decoded text) or verified (the verification "
        "pass's, after the drafts); `op-tree-*`: DDTree rollouts at budget 16 (`on_policy.rollout=ddtree`, "
        "text teacher, the accepted path's depth as the accepted slots). Target tokens: the compute the arms "
        "spent on the target (an SFT step: one 512-token row; an on-policy step: its rollout and one pass over "
        "the rollout's text). Served: real speculative decoding of the first 8 held-out prompts (64 tokens), "
        "what `speculate` runs; teacher-forced and decode-path columns: all held-out rows.",
        "",
        "| arm | tau per seed (teacher-forced) | mean tau | DDTree-16 | decode-path tau | served chain | "
        "served DDTree-16 | T=1 expected | T=1 served chain | T=1 served DDTree-16 | target tokens | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, rs in by_arm.items():
        if not rs:
            continue
        per_seed = " / ".join(f"{r['tau']:.3f}" for r in rs)
        lines.append(
            f"| {arm} | {per_seed} | "
            + " | ".join(f"{mean([r[k] for r in rs]):.3f}" for k in SCORES)
            + f" | {mean([r['target_tokens'] for r in rs]):,.0f} | {mean([r['train_seconds'] for r in rs]):.0f} |"
        )
    lines += kept_and_slot_lines(runs, by_arm)
    (RESULTS / "on_policy.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=800, help="S: the SFT arm's steps (the demo's default)")
    ap.add_argument("--on-policy", type=int, default=100, help="k: on-policy steps replacing as many SFT steps")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", default="runs/bench-on-policy")
    ap.add_argument("--one", type=int, metavar="SEED", help=argparse.SUPPRESS)  # a worker's job
    args = ap.parse_args()
    root = Path(args.out)
    if args.one is not None:
        print(json.dumps(run_seed(root, args.one, args.steps, args.on_policy, args.arms)), flush=True)
        return
    t0 = time.time()
    demo_data(root)
    # one process per seed, one torch thread each, side by side (a run's numbers do not depend on it)
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if len(args.seeds) > 1 else dict(os.environ)
    procs = []
    for seed in args.seeds:
        cmd = [sys.executable, __file__, "--out", str(root), "--steps", str(args.steps)]
        cmd += ["--on-policy", str(args.on_policy), "--arms", *args.arms, "--one", str(seed)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    runs = kept_runs(RESULTS / "on_policy.json", "arm", args.arms, list(ARMS))
    for seed, proc in zip(args.seeds, procs):
        lines = proc.communicate()[0].strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"seed {seed} failed (exit {proc.returncode})")
        runs += json.loads(lines[-1])
        runs.sort(key=lambda r: (list(ARMS).index(r["arm"]) if r["arm"] in ARMS else 99, r["seed"]))
        write_results(args, root, runs, t0)


if __name__ == "__main__":
    main()
