"""`dflash-train demo`, the main job, end to end in a real process on the embedded tiny target."""

import json
import subprocess
import sys

from dflash_trainer.config import load_config


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo-run"
    result = subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", "demo", "--set", f"output_dir={out}",
         "--eval-files", "3", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "[4/4] greedy continuation" in result.stdout
    # The resolved config is written and reloads to exactly what the run used.
    assert load_config([str(out / "run.yaml")]) == load_config(["tiny-demo"], [f"output_dir={out}"])
    summary = json.loads((out / "demo.json").read_text())
    held = summary["held_out"]
    assert held["tokens"] > 500 and held["accuracy"] > held["unigram_accuracy"]
    assert summary["continuation"]  # eight greedy tokens decode to some text
