"""train.optimizer (AdamW | Muon + AdamW), train.schedule (cosine | linear | wsd) and train.epochs: the
schedules' values, which parameters Muon takes, that Muon's update is orthogonalized, that a Muon +
WSD run resumes bit-identically, that epochs set the steps, and the planner's Muon pricing against the
real optimizer's states and its measured step."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from test_train import SMALL, losses, write_data

from dflash_trainer.config import load_config
from dflash_trainer.model.drafter import DrafterSpec
from dflash_trainer.planner import formulas as F
from dflash_trainer.planner.report import workload_from_config
from dflash_trainer.precision import cpu_has_bf16_gemm, muon_ns_dtype
from dflash_trainer.training.checkpoint import config_changes
from dflash_trainer.training.optim import (
    Muon,
    Optimizers,
    muon_matrices,
    newton_schulz,
    schedule_factor,
    steps_for_epochs,
)
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.trainer import Trainer
from dflash_trainer.variants import make_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def train_cfg(*overrides):
    return load_config([], ["drafter.mask_token_id=3", *overrides])


def test_schedules_follow_their_formulas():
    # 100 steps, 10 warmup, floor 0.1: every value written out from the formula's definition
    common = ("train.max_steps=100", "train.warmup_ratio=0.1", "train.min_lr_ratio=0.1")
    cos = schedule_factor(train_cfg(*common, "train.schedule=cosine"))
    lin = schedule_factor(train_cfg(*common, "train.schedule=linear"))
    wsd = schedule_factor(train_cfg(*common, "train.schedule=wsd", "train.decay_ratio=0.2"))
    for f in (cos, lin, wsd):
        assert [f(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # (step + 1) / warmup
    assert cos(10) == lin(10) == 1.0
    # each side a formula of at most 8 float64 operations (cos within an ulp) on values <= 2: at most
    # 8 roundings of u 2 each, on each side
    apart = 2 * 8 * 2 * 2.0**-53
    assert cos(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), abs=apart)
    assert lin(55) == pytest.approx(0.1 + 0.9 * 0.5, abs=apart)
    assert lin(99) == pytest.approx(0.1 + 0.9 * (1 - 89 / 90), abs=apart)
    # WSD: constant through step 80 (the last 20 steps decay), then a line to the floor
    assert all(wsd(s) == 1.0 for s in range(10, 81))
    assert wsd(90) == pytest.approx(0.1 + 0.9 * 0.5, abs=apart)
    assert wsd(99) == pytest.approx(0.1 + 0.9 * (1 - 19 / 20), abs=apart)
    assert wsd(100) == pytest.approx(0.1, abs=apart)


def test_epochs_give_the_steps_of_that_many_passes():
    assert steps_for_epochs(1, 40, 1) == 40
    assert steps_for_epochs(2.5, 40, 3) == math.ceil(100 / 3)
    assert steps_for_epochs(0.01, 40, 4) == 1
    with pytest.raises(Exception, match="train.epochs"):
        train_cfg("train.epochs=0")


def spec_for(variant: str, width: int = 48, **settings) -> DrafterSpec:
    cfg = load_config(["tiny-demo"], [f"drafter.variant={variant}"] if variant != "dflash" else [])
    options = cfg.drafter.variant_settings.model_dump() if variant != "dflash" else {}
    options.update(settings)
    return DrafterSpec(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=width,
        vocab_size=160,
        num_layers=2,
        num_features=3,
        block_size=4,
        variant=variant,
        variant_options=options,
    )


VARIANTS = [
    ("dflash", {}),
    ("dflash", {"width": 160}),  # an MLP as wide as the vocabulary is still a hidden matrix
    ("dspark", {"markov_rank": 8, "markov_head_type": "gated"}),
    ("dflash2", {"selector_rank": 8, "selector_top_k": 4, "conv_group_size": 8}),
]


@pytest.mark.parametrize("variant,settings", VARIANTS)
def test_muon_takes_the_hidden_matrices_and_the_planner_prices_its_states(variant, settings):
    """Muon holds every 2-D parameter without a vocabulary-sized side, AdamW the rest; the planner's
    matrices are exactly those, and its state bytes are what the two optimizers hold after a step."""
    spec = spec_for(variant, **settings)
    drafter = make_drafter(spec, torch.nn.Embedding(spec.vocab_size, spec.hidden_size), torch.zeros(160, 32)).float()
    cfg = train_cfg("train.optimizer=muon", f"drafter.variant={variant}")
    in_muon = muon_matrices(drafter)
    opt = Optimizers(list(drafter.parameters()), cfg, in_muon)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    assert {id(p) for p in opt.muon.param_groups[0]["params"]} == {id(p) for p in in_muon}
    assert sum(len(g["params"]) for g in opt.adamw.param_groups) == len(trainable) - len(in_muon)
    assert all(p.dim() == 2 for p in in_muon) and len(in_muon) >= 1 + 7 * spec.num_layers
    if variant != "dflash":  # the variant's vocabulary-sized codebooks stay on AdamW
        assert len(in_muon) < sum(1 for p in trainable if p.dim() == 2)

    dims = F.DrafterDims(32, 4, 2, 8, spec.intermediate_size, 160)
    opts = [f"drafter.{variant}.{k}={v}" for k, v in settings.items()] if variant != "dflash" else []
    w = workload_from_config(
        load_config([], [f"drafter.variant={variant}", *opts, "drafter.num_layers=2", "target.num_feature_layers=3"])
    )
    assert sorted(F.muon_matrix_shapes(w, dims)) == sorted(tuple(p.shape) for p in in_muon)

    for p in trainable:
        p.grad = torch.randn_like(p)
    opt.step()
    held = sum(t.nbytes for st in opt.state() for t in st.values() if torch.is_tensor(t))
    params = sum(p.numel() for p in trainable)
    assert held == F.muon_state_bytes(params, len(trainable), F.muon_matrix_shapes(w, dims))
    adamw = Optimizers(list(drafter.parameters()), train_cfg("train.optimizer=adamw"), in_muon)
    adamw.step()
    held = sum(t.nbytes for st in adamw.state() for t in st.values() if torch.is_tensor(t))
    assert held == F.optimizer_state_bytes(params, len(trainable))


def test_muon_step_is_orthogonalized_and_the_planner_bounds_its_temporaries():
    """One Muon step on a matrix from zero momentum moves it by lr * 0.2 sqrt(max(A, B)) * NS(g): the
    Newton-Schulz iterate's singular values lie near 1 (torch documents S' ~ U(0.5, 1.5); bf16 rounds
    them by ~1%), so max/min < 4, where AdamW's first step (lr * g / |g| per entry) has them spread
    like a random sign matrix's (sqrt(B) +- sqrt(A)). The allocator's peak over the next step holds at
    least the tensors the planner's CUDA transient counts and at most its CPU one (those plus a bf16
    GEMM's fp32 workspace)."""
    from planner_measure import allocator_peak

    torch.manual_seed(0)
    a, b = 64, 96
    spec_cfg = train_cfg("train.optimizer=muon", "train.lr=1e-3", "train.warmup_ratio=0", "train.muon_weight_decay=0")
    for kind in ("muon", "adamw"):
        w = torch.nn.Parameter(torch.randn(a, b) * 0.02)
        before = w.detach().clone()
        cfg = (
            spec_cfg if kind == "muon" else train_cfg("train.optimizer=adamw", "train.lr=1e-3", "train.warmup_ratio=0")
        )
        opt = Optimizers([w], cfg, [w])
        w.grad = torch.randn(a, b)
        opt.step()
        s = torch.linalg.svdvals((w.detach() - before).double())
        if kind == "muon":
            s = s / (1e-3 * 0.2 * math.sqrt(max(a, b)))
            assert 0.3 < s.min() and s.max() < 1.7 and s.max() / s.min() < 4, s
            _, peak, _ = allocator_peak(opt.step)  # the momentum buffer exists now
            ns = muon_ns_dtype("cpu").itemsize  # this CPU's Newton-Schulz dtype
            assert F.muon_step_transient([(a, b)], "cuda", ns) <= peak <= F.muon_step_transient([(a, b)], "cpu", ns)
        else:
            assert s.max() / s.min() > 4, s


@pytest.mark.parametrize("nesterov, adjust", [(True, "match_rms_adamw"), (False, "original"), (True, None)])
def test_our_muon_in_bf16_is_torchs_muon_bit_for_bit(nesterov, adjust):
    """Muon with ns_dtype=bf16 is torch.optim.Muon: the same parameters and momentum buffers bit for bit
    after three steps on tall, wide and square matrices, and the same state dict (a checkpoint of
    either loads into the other)."""
    torch.manual_seed(0)
    shapes = [(48, 80), (80, 48), (64, 64)]
    start = [torch.randn(*s) * 0.05 for s in shapes]
    grads = [[torch.randn(*s) for s in shapes] for _ in range(3)]
    runs = {}
    for name in ("ours", "torch"):
        params = [torch.nn.Parameter(x.clone()) for x in start]
        kw = dict(lr=2e-3, weight_decay=0.05, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
        opt = Muon(params, ns_dtype=torch.bfloat16, **kw) if name == "ours" else torch.optim.Muon(params, **kw)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        runs[name] = (params, opt)
    (ours, a), (theirs, b) = runs["ours"], runs["torch"]
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    assert all(torch.equal(a.state[x]["momentum_buffer"], b.state[y]["momentum_buffer"]) for x, y in zip(ours, theirs))
    assert a.state_dict()["param_groups"] == b.state_dict()["param_groups"]
    b.load_state_dict(a.state_dict())


def test_newton_schulz_in_fp32_is_closer_to_float64_than_torchs_bf16():
    """The fp32 iteration (CPUs without bf16 GEMMs) carries 16 more mantissa bits than bf16 through the
    same five polynomial steps, so its distance to the float64 iteration is below bf16's by far: at
    least 2^8 smaller (the 2^16 of the units less a 2^8 allowance for how each rounds its way through
    the iteration). The momentum buffer it is given is never written to."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS

    torch.manual_seed(1)
    coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    for shape in [(64, 256), (256, 64), (96, 96)]:
        g = torch.randn(*shape)
        kept = g.clone()
        exact = newton_schulz(g.double(), coefficients, DEFAULT_NS_STEPS, EPS, torch.float64)
        err = {
            dt: (newton_schulz(g, coefficients, DEFAULT_NS_STEPS, EPS, dt).double() - exact).norm().item()
            for dt in (torch.bfloat16, torch.float32)
        }
        assert err[torch.float32] <= err[torch.bfloat16] / 2**8, (shape, err)
        assert torch.equal(g, kept)
    assert muon_ns_dtype("cuda") == torch.bfloat16
    assert muon_ns_dtype("cpu") == (torch.bfloat16 if cpu_has_bf16_gemm() else torch.float32)


MUON_WSD = ["train.optimizer=muon", "train.schedule=wsd", "loss.position_weights=dpace"]


def test_muon_wsd_run_resumes_bit_identically_and_refuses_another_optimizer(tmp_path):
    data = write_data(tmp_path / "data.jsonl", n=12)
    common = [*SMALL, f"data.train_files=[{data}]", "train.max_steps=12", "train.eval_every=12", *MUON_WSD]
    cfg = load_config(["tiny-demo"], [*common, f"output_dir={tmp_path / 'full'}"])
    target, tok, rows, eval_rows, _ = prepare(cfg)
    full = Trainer(cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "full", target_path="tiny", progress=False)
    full.fit()
    reference = losses(tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoints" / "step-0000006"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert {"optimizer", "scheduler", "muon_optimizer", "muon_scheduler"} <= set(state)
    assert state["muon_optimizer"]["state"] and all(
        "momentum_buffer" in s for s in state["muon_optimizer"]["state"].values()
    )

    cfg2 = load_config(["tiny-demo"], [*common, f"output_dir={tmp_path / 'resumed'}"])
    resumed = Trainer(
        cfg2, target, tok, rows, eval_rows, out_dir=tmp_path / "resumed", target_path="tiny", progress=False
    )
    resumed.fit(resume=str(ckpt))
    after = losses(tmp_path / "resumed")
    assert sorted(after) == list(range(7, 13))
    for step, value in after.items():
        assert value == reference[step], (step, value, reference[step])  # bit-identical
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert lrs[-1] < lrs[5] == lrs[6]  # WSD: constant, then decaying

    adamw = load_config(["tiny-demo"], [*common, "train.optimizer=adamw", f"output_dir={tmp_path / 'other'}"])
    assert any(c.startswith("train.optimizer: 'muon' -> 'adamw'") for c in config_changes(ckpt, adamw))


def test_epochs_set_the_steps_and_progress_is_logged_in_epochs(tmp_path, capsys):
    from dflash_trainer.commands.train import run_training

    data = write_data(tmp_path / "data.jsonl", n=12)
    out = tmp_path / "run"
    cfg = load_config(
        ["tiny-demo"],
        [*SMALL, f"data.train_files=[{data}]", f"output_dir={out}", "train.epochs=1.5", "train.grad_accum=2"],
    )
    summary = run_training(cfg, progress=False)
    printed = capsys.readouterr().out
    n = int(printed.split(" training rows")[0].split()[-1])
    assert summary["steps"] == math.ceil(1.5 * n / 2)
    assert f"train.epochs 1.5 = {summary['steps']} steps of 2 rows" in printed
    import yaml

    assert yaml.safe_load((out / "run.yaml").read_text())["train"]["max_steps"] == summary["steps"]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epoch"] >= 1.5
    assert all(a["epoch"] < b["epoch"] for a, b in zip(records, records[1:]))


def test_the_plan_prices_muon_at_the_seed_scale():
    """At the 27B seed configuration Muon holds one fp32 state per hidden matrix where AdamW holds two: the
    plan's optimizer states shrink by 4 bytes per Muon parameter, its report names Muon's step."""
    from dflash_trainer.planner import plan_for_config, render_text

    plans = {
        opt: plan_for_config(load_config(["ddtree-experiment"], [f"train.optimizer={opt}"]))
        for opt in ("adamw", "muon")
    }
    items = {opt: {i.name: i.bytes for i in p.devices[-1].items} for opt, p in plans.items()}
    adamw, muon = (
        items["adamw"]["optimizer states (AdamW, fp32)"],
        items["muon"]["optimizer states (Muon + AdamW, fp32)"],
    )
    w = plans["muon"].workload
    d = F.DrafterDims.of(plans["muon"].target, w.drafter_intermediate)
    matrices = F.muon_matrix_shapes(w, d)
    assert adamw - muon == 4 * sum(a * b for a, b in matrices) + 4 * len(matrices)
    assert muon < 0.6 * adamw  # nearly every drafter parameter is a hidden matrix
    assert "optimizer states (Muon + AdamW, fp32)" in render_text(plans["muon"])
