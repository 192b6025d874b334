"""benchmarks/bench_meta_trace.py at toy shapes: the seed's step traced by MemTracker on fake tensors
agrees with the planner phase by phase (the committed full-shape results are in benchmarks/results/)."""

import json

import bench_meta_trace


def test_small_trace_matches_the_planner_within_the_goal(tmp_path):
    assert bench_meta_trace.main(["--small", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "meta_trace.json").read_text())
    phases = {(r["role"], r["phase"]) for r in result["rows"]}
    assert phases == {
        ("drafter rank", "drafter forward"),
        ("drafter rank", "loss"),
        ("drafter rank", "backward"),
        ("drafter rank", "optimizer"),
        ("target rank", "target forward"),
    }
    for r in result["rows"]:
        assert r["traced_bytes"] > 0 and r["within_goal"], r
    loss = next(r for r in result["rows"] if r["phase"] == "loss")
    assert loss["priced_separately"]["fused loss chunk workspace"] > 0  # what the opaque op keeps inside
    cats = result["drafter_peak_by_category"]
    assert cats["Optstate"] > 0 and cats["Parameter"] > 0  # AdamW's states and the fp32 master weights
    assert "| drafter rank | backward |" in (tmp_path / "meta_trace.md").read_text()
