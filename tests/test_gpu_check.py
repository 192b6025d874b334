"""benchmarks/gpu_check.py, the one command a GPU window runs: its --small mode on the CPU, every section."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_check
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The whole script, as a user runs it, at toy sizes on the CPU (one thread: the machine is shared)."""
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    return proc, out


def test_small_run_passes_every_section(small_run):
    proc, out = small_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "gpu.json").read_text())
    assert list(data["sections"]) == list(gpu_check.SECTIONS)
    assert {name: sec["status"] for name, sec in data["sections"].items()} == dict.fromkeys(gpu_check.SECTIONS, "ok")
    md = (out / "gpu.md").read_text()
    for name in gpu_check.SECTIONS:
        assert f"## {name}" in md
    # which fast paths were found and used: the CPU takes the native loss kernel, hybrids their torch loops
    fp = data["meta"]["fast_paths"]
    assert set(fp["found"]) == set(gpu_check.FAST_PATH_PACKAGES)
    assert fp["used"]["loss chunk epilogue (bf16 head)"] == "native"
    assert fp["used"]["hybrid layers: gated delta rule"] in ("torch fallback", "fla")
    assert "Fast paths found: triton" in md


def test_attention_flex_matches_dense_on_documents_and_windows(small_run):
    rows = json.loads((small_run[1] / "gpu.json").read_text())["sections"]["attention"]["result"]["rows"]
    assert {(r["layers"], r["dtype"]) for r in rows} == {
        (layers, dtype)
        for layers in ("sliding + full", "sliding (block-causal) + full")
        for dtype in ("fp32", "bf16 autocast")
    }
    for r in rows:
        assert r["pass"]
        assert "CPU" in r["grad"]  # flex has no CPU backward: reported, not silently skipped
        assert r["grad_dense_vs_fp64"] < (1e-4 if r["dtype"] == "fp32" else 0.2)  # the dense backward is checked
        assert r["fwd_flex_vs_dense"] < (1e-5 if r["dtype"] == "fp32" else 5e-2)


def test_loss_section_compares_fused_with_the_reference(small_run):
    result = json.loads((small_run[1] / "gpu.json").read_text())["sections"]["loss"]["result"]
    by = {r["variant"]: r for r in result["rows"]}
    fused, ref = by["fused CE + 15% KL + CAP"], by["reference (full logits) CE + 15% KL + CAP"]
    assert abs(fused["loss"] - ref["loss"]) < 1e-3 * abs(ref["loss"])  # same terms, same value
    assert fused["peak_extra_bytes"] < ref["peak_extra_bytes"]  # the reference holds [N, V] logits
    assert all(0 < r["gemm_efficiency"] for r in result["rows"] if "time_s" in r)


def test_step_section_measures_every_planner_phase(small_run):
    result = json.loads((small_run[1] / "gpu.json").read_text())["sections"]["step"]["result"]
    phases = {p["phase"]: p for p in result["phases"]}
    assert set(phases) == {"target forward", "drafter forward", "loss", "backward", "optimizer"}
    for p in phases.values():  # the CPU calibration holds the planner to 10%; here only a sanity bound
        assert 0.8 < p["ratio"] < 1.2, p
    assert result["steps_per_s"] > 0 and result["last_loss"] is not None


def test_speculative_section_is_lossless(small_run):
    result = json.loads((small_run[1] / "gpu.json").read_text())["sections"]["speculative"]["result"]
    modes = [r["mode"] for r in result["rows"]]
    assert modes[0].startswith("target only") and "chain" in modes and any(m.startswith("DDTree") for m in modes)
    assert all(r["lossless"] for r in result["rows"])


def test_a_failing_section_is_recorded_and_the_next_one_still_runs(tmp_path, monkeypatch):
    def broken(ctx):
        ctx.partial = {"rows": [{"variant": "half done"}]}
        raise RuntimeError("boom")

    def fine(ctx):
        return {
            "prompts": {"train": 1, "eval": 1},
            "regenerate_s": 0.0,
            "train_steps": 0,
            "train_s": 0.0,
            "rows": [{"mode": "target only (greedy)", "tokens": 1, "tokens_per_s": 1.0, "lossless": True}],
            "ok": True,
        }

    monkeypatch.setitem(gpu_check.RUNNERS, "attention", broken)
    monkeypatch.setitem(gpu_check.RUNNERS, "speculative", fine)
    code = gpu_check.main(["--small", "--device", "cpu", "--out", str(tmp_path), "--sections", "attention,speculative"])
    assert code == 1
    data = json.loads((tmp_path / "gpu.json").read_text())
    att = data["sections"]["attention"]
    assert att["status"] == "failed" and att["error"] == "RuntimeError: boom"
    assert att["result"] == {"rows": [{"variant": "half done"}]}  # what it measured before failing is kept
    assert data["sections"]["speculative"]["status"] == "ok"
    md = (tmp_path / "gpu.md").read_text()
    assert "RuntimeError: boom" in md and "## speculative" in md


def test_bad_arguments_are_one_line_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cases = [
        (["--sections", "attention,nope"], "unknown section 'nope'"),
        (["--device", "cuda"], "torch sees no CUDA device"),
    ]
    for args, needle in cases:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--out", str(tmp_path), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
