"""Speculative decoding on each target family: lossless, and what verification costs in target tokens.

    .venv/bin/python benchmarks/bench_families.py     # writes benchmarks/results/families.{json,md}

Each family is a tiny random model (tests/families.py). Drafts come from the reference greedy
continuation with about a third of the slots corrupted (tests/test_families.py ``OracleDrafts``), the
same draft stream for every family, so the accepted lengths are equal and the target-token counts show
the cost of each cache strategy: attention-only targets verify ``1 + nodes`` tokens per round; hybrid
(recurrent) targets replay the accepted tokens after a rejecting chain round, and verify a tree as one
chain per root-to-leaf path (``paths * (depth + 1)`` tokens) plus the replay.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from families import FAMILIES, build_family  # noqa: E402
from test_families import PROMPT, OracleDrafts  # noqa: E402

from dflash_trainer.inference.speculative import target_greedy  # noqa: E402
from dflash_trainer.model.target import TargetModel  # noqa: E402

NEW_TOKENS = 40
MODES = [("chain", 1), ("ddtree", 10)]


def main() -> None:
    rows = []
    for family in FAMILIES:
        model = build_family(family)
        greedy, _ = target_greedy(model, PROMPT, NEW_TOKENS, [0])
        target = TargetModel(model, layer_ids=[1, 2])
        for mode, budget in MODES:
            decoder = OracleDrafts(target, PROMPT + greedy)
            t0 = time.perf_counter()
            res = decoder.generate(PROMPT, NEW_TOKENS, mode, budget=budget)
            rows.append(
                {
                    "family": family,
                    "mode": f"{mode} (budget {budget})" if mode == "ddtree" else mode,
                    "lossless": res.tokens == greedy,
                    "rounds": len(res.accepted),
                    "tau": round(res.tau, 2),
                    "target_tokens_after_prompt": decoder.target_tokens - len(PROMPT),
                    "packs_documents": target.packs_documents,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            )
            print(rows[-1], flush=True)
    out = ROOT / "benchmarks" / "results"
    (out / "families.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| family | mode | lossless | rounds | tau | target tokens after the prompt | packs documents |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['mode']} | {r['lossless']} | {r['rounds']} | {r['tau']} | "
            f"{r['target_tokens_after_prompt']} | {r['packs_documents']} |"
        )
    (out / "families.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
