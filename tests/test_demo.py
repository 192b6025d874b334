"""`dflash-train demo`, the main job, end to end in a real process on the embedded tiny target
(shortened: fewer prompts, shorter responses, fewer steps than `make demo`)."""

import json
import subprocess
import sys

from dflash_trainer.config import load_config
from dflash_trainer.precision import preferred_train_dtype
from dflash_trainer.training.checkpoint import verify_checkpoint


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo-run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_trainer.cli",
            "demo",
            "--set",
            f"output_dir={out}",
            "--set",
            "train.max_steps=12",
            "--set",
            "train.eval_every=12",
            "--set",
            "train.save_every=12",
            "--set",
            "data.max_eval_rows=1",
            "--prompts-per-file",
            "1",
            "--max-new-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    assert "[5/5] trained" in result.stdout and "dflash-train export --format zlab" in result.stdout
    cfg = load_config([str(out / "run.yaml")])
    assert cfg.train.max_steps == 12 and cfg.data.train_files == [str(out / "train.jsonl")]
    # bf16 autocast where this CPU has bf16 GEMMs, fp32 elsewhere; recorded in run.yaml
    assert cfg.train.dtype == preferred_train_dtype("cpu") and f"train.dtype={cfg.train.dtype}" in result.stdout
    summary = json.loads((out / "demo.json").read_text())
    assert summary["records"]["train"] > 20 and summary["records"]["eval"] > 2
    assert 1.0 <= summary["tau_before"]["tau"] <= cfg.drafter.block_size
    assert 1.0 <= summary["tau_after"]["tau"] <= cfg.drafter.block_size
    # tau at T = 1 (speculative sampling), expected and measured, printed next to the greedy one
    t1 = summary["tau_t1"]
    assert 1.0 <= t1["expected"] <= cfg.drafter.block_size and 1.0 <= t1["measured"] <= cfg.drafter.block_size
    assert "at T=1 (speculative sampling)" in result.stdout
    assert verify_checkpoint(out / "checkpoints" / "step-0000012") is None
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert all(p["messages"][0]["content"].startswith("Continue the Python module") for p in prompts)
