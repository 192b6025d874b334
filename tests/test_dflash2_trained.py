"""DFlash2 end to end on the embedded tiny target, one drafter trained on the target's greedy
continuations for the whole file: the training step against the plain reference, the selector's
metrics in metrics.jsonl, the checkpoint round trip, lossless greedy decoding (chain and the
selector's DDTree), lossless sampling in distribution and eval's tau(T), `dflash-train eval` with
candidate recall, and the planner's parameter count against the real drafter."""

import json

import pytest
import torch
from test_speculative import check_expected_acceptance, check_sampling_is_lossless, sampled_runner
from trained import EOS, train_on_greedy

from dflash_trainer.drafter_folder import load_drafter
from dflash_trainer.inference.acceptance import acceptance_report
from dflash_trainer.inference.speculative import SpeculativeDecoder, target_greedy
from dflash_trainer.variants import variant_of

STEPS = 100


@pytest.fixture(scope="module")
def trained():
    out = train_on_greedy(
        "drafter.variant=dflash2",
        "drafter.dflash2.selector_rank=32",
        "drafter.dflash2.selector_top_k=8",
        steps=STEPS,
    )
    assert out["drafter"].spec.variant == "dflash2"
    return out


@pytest.fixture(scope="module")
def sampled_runs(trained):
    return sampled_runner(trained)


def test_training_logs_the_selector_and_learns_it(trained):
    records = [json.loads(line) for line in (trained["root"] / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = records[:5], records[-10:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    for key in ("selector_ce", "candidate_recall", "selector_accuracy"):
        assert all(key in r for r in records), key
    assert mean(last, "selector_ce") < mean(first, "selector_ce") - 1.0
    assert mean(last, "candidate_recall") > mean(first, "candidate_recall") + 0.2
    assert 0.0 < mean(last, "selector_accuracy") <= 1.0
    # the convolutions and the selector moved away from their initial values
    d = trained["drafter"]
    assert d.layers[0].attention_conv.kernel_projection.weight.abs().max() > 0
    assert not torch.allclose(
        d.layers[0].mlp_conv.base_kernel[:, 0], torch.ones_like(d.layers[0].mlp_conv.base_kernel[:, 0])
    )


def test_checkpoint_round_trip_and_greedy_decoding_is_lossless(trained):
    target = trained["target"]
    drafter, meta = load_drafter(trained["ckpt"], target)
    assert meta["spec"]["variant"] == "dflash2" and hasattr(drafter, "candidate_selector")
    for a, b in zip(drafter.state_dict().values(), trained["drafter"].state_dict().values()):
        assert torch.equal(a, b)
    decoder = SpeculativeDecoder(target, drafter, EOS)
    accepted = []
    for prompt in trained["prompts"][:3]:
        greedy, _ = target_greedy(target.model, prompt, 40, EOS)
        for mode in ("chain", "ddtree"):
            out = decoder.generate(prompt, 40, mode=mode, budget=16)
            assert out.tokens == greedy, mode
            assert max(out.drafted) == drafter.spec.block_size - 1
            accepted += out.accepted
    assert max(accepted) >= 3, "the trained drafter's drafts are accepted, so decoding exercises the walk"


def test_eval_tau_is_the_decode_walk_and_reports_candidate_recall(trained):
    target, drafter, rows = trained["target"], trained["drafter"], trained["eval_rows"]
    report = acceptance_report(target, drafter, rows[:2], budgets=[4, 16], max_blocks_per_row=16)
    b = drafter.spec.block_size
    assert len(report["slot_acceptance"]) == b - 1 and len(report["candidate_recall"]["per_slot"]) == b - 1
    # a drafted token is always one of the slot's candidates: acceptance never exceeds recall
    for acc, rec in zip(report["slot_acceptance"], report["candidate_recall"]["per_slot"]):
        assert acc <= rec + 1e-12
    assert report["ddtree_tau"][1] >= report["ddtree_tau"][0] > 1.0  # a larger budget's tree holds the smaller
    assert 1.0 < report["decode_tau"] <= b


@pytest.mark.parametrize("mode, budget, temperature, top_p", [("chain", 1, 1.0, 1.0), ("ddtree", 8, 0.7, 0.9)])
def test_dflash2_sampling_is_lossless_in_distribution(trained, sampled_runs, mode, budget, temperature, top_p):
    check_sampling_is_lossless(trained, sampled_runs, mode, budget, temperature, top_p)


def test_dflash2_expected_ddtree_acceptance_is_the_mean_of_measured_acceptance(trained):
    check_expected_acceptance(trained, "ddtree", 8, 0.7, 0.9)


def test_eval_command_on_a_dflash2_checkpoint(trained, tmp_path, capsys):
    from dflash_trainer.cli import main

    out = tmp_path / "eval"
    code = main(
        ["eval", str(trained["ckpt"]), "--data", str(trained["root"] / "data.jsonl"), "--out", str(out)]
        + ["--budgets", "4,16", "--max-blocks-per-row", "8"]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())["checkpoints"][0]["report"]
    assert 0.0 < report["candidate_recall"]["mean"] <= 1.0
    assert "candidate recall per slot" in capsys.readouterr().out


def test_planner_prices_the_real_drafters_parameters(trained):
    """The planner's DFlash2 parameters (convolutions in every layer, codebooks, projection) are the
    drafter's, and its plan adds the selector's rows and the convolutions' activations to DFlash's."""
    from dflash_trainer.config import load_config
    from dflash_trainer.planner import formulas as F
    from dflash_trainer.planner.report import workload_from_config

    drafter = trained["drafter"]
    spec = drafter.spec
    extra = sum(p.numel() for n, p in drafter.named_parameters() if "conv" in n or n.startswith("candidate_selector"))
    overrides = [f"drafter.dflash2.{k}={spec.variant_options[k]}" for k in ("selector_rank", "selector_top_k")]
    cfg = load_config(["tiny-demo"], ["drafter.variant=dflash2", *overrides])
    w = workload_from_config(cfg)
    dims = F.DrafterDims(
        spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size, spec.vocab_size
    )
    params, tensors, _ = F.variant_head_params(w, dims)
    assert params == extra > 0
    assert tensors == len([n for n, _ in drafter.named_parameters() if "conv" in n or "candidate_selector" in n])
    plain = workload_from_config(load_config(["tiny-demo"], []))
    layer = F.layer_saved(dims, w, "cpu", first=False)
    assert layer["local convolutions"] > 0 and "local convolutions" not in F.layer_saved(dims, plain, "cpu", False)
    assert F.variant_loss_items(w, dims)["candidate selector (top-K rows)"] > 0
    assert F.variant_loss_items(plain, dims) == {}
    assert variant_of(spec).name == "dflash2"
