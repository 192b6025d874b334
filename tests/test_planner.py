"""The memory planner: its formulas against the real objects and real CPU steps, the seed's case, the CLI."""

import importlib.util
import io
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from planner_measure import allocator_peak, measure_in_subprocess, predict_case

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.errors import UserError
from dflash_trainer.loss import LossTerms, PairTerm, fused_draft_loss
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.planner import (
    Topology,
    load_target_shape,
    make_plan,
    plan_for_config,
    render_json,
    render_text,
    target_param_count,
)
from dflash_trainer.planner import formulas as F
from dflash_trainer.planner.preflight import preflight
from dflash_trainer.planner.shapes import GB, TargetShape, formula_param_count, gpu_memory

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_planner", ROOT / "benchmarks" / "bench_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- formulas against the real objects -----------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3.6-27b", "qwen3-8b", "tiny"])
def test_target_param_count_matches_transformers(name):
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    shape = load_target_shape(name)
    c = {k: v for k, v in shape.config.items() if k != "model_type"}
    config = Qwen3_5TextConfig(**c) if shape.model_type == "qwen3_5_text" else Qwen3Config(**c)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert formula_param_count(shape) == target_param_count(shape) == sum(p.numel() for p in model.parameters())
    if name == "qwen3.6-27b":  # DESIGN.md: 54 GB of bf16 weights
        assert abs(target_param_count(shape) * 2 / GB - 54) < 0.5


@pytest.mark.parametrize("name", ["qwen3.6-27b", "tiny"])
def test_target_gpu_weights_are_what_a_target_rank_keeps(name):
    """A target rank drops the output head (``keep_only("body")``); a tied head is the embedding and stays."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    from dflash_trainer.model.target import TargetModel
    from dflash_trainer.planner.plan import _target_layer_ids, target_device_plan

    shape = load_target_shape(name)
    c = {k: v for k, v in shape.config.items() if k != "model_type"}
    config = Qwen3_5TextConfig(**c) if shape.model_type == "qwen3_5_text" else Qwen3Config(**c)
    # meta for the 27B (hybrid: TargetModel runs no probe forward); the tiny one is real (its packing probe runs)
    with torch.device("meta" if shape.num_linear_attention else "cpu"):
        target = TargetModel(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), num_feature_layers=2)
    target.keep_only("body")
    kept = sum(p.numel() * p.element_size() for p in target.model.parameters())  # shared tensors counted once
    cfg = load_config(
        ["ddtree-experiment"], ["target.path=null", f"topology.target_model={name}", "target.layer_ids=null"]
    )
    plan = plan_for_config(cfg)
    ids = _target_layer_ids(shape, plan.workload, None)
    topo = Topology(memory=int(100 * GB), device_name="x", target_gpus=1)
    dev = target_device_plan(shape, plan.workload, topo, ids)
    weights = next(i.bytes for i in dev.items if i.name == "target weights")
    assert weights == kept
    full = target_param_count(shape) * 2
    assert (weights < full) == (not shape.tie_word_embeddings)


@pytest.mark.parametrize("layers,k,heads,kv,hd,inter", [(1, 5, 4, 2, 8, 48), (3, 3, 6, 3, 4, 40), (5, 5, 2, 1, 16, 24)])
def test_drafter_param_count_matches_the_real_drafter(layers, k, heads, kv, hd, inter):
    hidden, vocab = 32, 64
    spec = DrafterSpec(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hd,
        intermediate_size=inter,
        vocab_size=vocab,
        num_layers=layers,
        num_features=k,
        block_size=4,
    )
    drafter = DFlashDrafter(spec, torch.nn.Embedding(vocab, hidden), torch.zeros(vocab, hidden))
    dims = F.DrafterDims(hidden, heads, kv, hd, inter, vocab)
    params = list(drafter.parameters())
    assert F.drafter_param_count(dims, layers, k) == sum(p.numel() for p in params)
    assert F.drafter_param_tensors(layers) == len(params)
    assert F.drafter_largest_param(dims, k) == max(p.numel() for p in params)


def loss_terms(terms: dict) -> LossTerms:
    """The loss terms of a ``Workload``'s loss fields: ``tv_weight`` is the TV pair term (1 - overlap)."""
    terms = dict(terms)
    tv_weight = terms.pop("tv_weight", 0.0)
    tv = (PairTerm("tv", "overlap", weight=tv_weight, scale=-1.0, offset=1.0),) if tv_weight else ()
    return LossTerms(**terms, pair_terms=tv)


@pytest.mark.parametrize(
    "terms",
    [
        {},
        {"kl_weight": 0.15},
        {"kl_weight": 0.5, "temperature": 2.0},
        {"kl_weight": 0.15, "cap_weight": 0.1},
        {"label_source": "teacher"},
        {"tv_weight": 0.5},  # TV runs the eager passes even where a kernel is asked for
        {"tv_weight": 0.5, "kl_weight": 0.3, "temperature": 2.0},
    ],
)
@pytest.mark.parametrize("kernel", [False, True], ids=["eager", "native"])
def test_loss_workspace_matches_the_fused_loss(terms, kernel):
    """The fused loss's forward pass, measured by the allocator, against ``loss_workspace`` plus the compacted
    input copies. The vocabulary dominates, so a changed number of [chunk, V] buffers shows at once."""
    n, h, v, chunk = 256, 16, 16384, 64
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, h, generator=g).requires_grad_()
    ht = torch.randn(n, h, generator=g)
    head = torch.randn(v, h, generator=g) * 0.1
    cap = terms.get("cap_weight", 0) > 0
    labels = (hs.detach() @ head.T).argmax(-1) if cap else torch.randint(0, v, (n,), generator=g)  # CAP: all correct
    weights = torch.ones(n)
    w = F.Workload(
        seq_len=2 * n,
        max_anchors=n,
        block_size=2,
        target_dtype="float32",
        train_dtype="float32",
        kl_weight=terms.get("kl_weight", 0.0),
        temperature=terms.get("temperature", 1.0),
        cap_weight=terms.get("cap_weight", 0.0),
        tv_weight=terms.get("tv_weight", 0.0),
        labels="teacher" if "label_source" in terms else "data",
    )
    teacher = ht if w.need_teacher else None  # as loss_of passes it
    loss = loss_terms(terms)
    _, extra, _ = allocator_peak(
        lambda: fused_draft_loss(
            hs, teacher, head, labels, weights, loss, chunk_size=chunk, compile="native" if kernel else False
        )
    )
    predicted = sum(F.loss_workspace(w, v, h, chunk, correct_fraction=1.0, kernel=kernel).values())
    predicted += n * h * 4 * (2 if w.need_teacher else 1)  # index_select copies of the kept rows
    assert abs(predicted / extra - 1) < 0.05, (predicted, extra)


def test_chunk_for_budget_inverts_the_workspace():
    w = F.Workload(seq_len=65536, max_anchors=1024, block_size=24, kl_weight=0.15, cap_weight=0.1)
    budget = int(4 * GB)
    c = F.chunk_for_budget(w, 248_320, 5120, budget)
    assert sum(F.loss_workspace(w, 248_320, 5120, c).values()) <= budget
    assert sum(F.loss_workspace(w, 248_320, 5120, c + 1).values()) > budget


# -- predicted vs measured: two cases of the validation sweep -----------------------------------


def test_predicted_peak_of_real_cpu_steps_within_10_percent():
    bench = _bench()
    cases = [c for c, _ in bench.CASES if c.name in bench.QUICK]
    assert len(cases) == 2
    with ThreadPoolExecutor(max_workers=2) as pool:
        measured = list(pool.map(measure_in_subprocess, cases))
    for case, m in zip(cases, measured):
        p = predict_case(case, m.get("accuracy"))
        assert abs(p["peak"] / m["peak"] - 1) <= 0.10, (case.name, p["peak"], m["peak"])
        assert set(m["phases"]) == set(p["phases"])
        for phase, value in m["phases"].items():  # every phase, not only the peak one
            assert abs(p["phases"][phase] / value - 1) <= 0.10, (case.name, phase, p["phases"][phase], value)


# -- the seed's case -----------------------------------------------------------------------------


def test_seed_case_fits_only_with_the_remedy_and_naive_reproduces_design_figures():
    cfg = load_config(["ddtree-experiment"])
    assert (cfg.topology.gpu, cfg.topology.target_ranks, cfg.topology.drafter_ranks) == ("rtx-pro-6000", 7, 1)
    plan = plan_for_config(cfg)
    assert plan.fits, render_text(plan)
    assert [d.role for d in plan.devices] == ["target GPU", "drafter GPU"]
    assert cfg.data.max_anchors * cfg.drafter.block_size == 24_576 and cfg.data.seq_len == 65_536

    without = plan_for_config(
        cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"activation_checkpointing": False})})
    )
    assert not without.fits
    assert any("activation_checkpointing=true" in r for r in without.recommendations)
    assert any("max_anchors=" in r for r in without.recommendations)

    naive = plan_for_config(cfg, naive=True)
    items = {i.name: i.bytes for d in naive.devices for i in d.items}
    assert round(items["target logits [L x V]"] / GB, 1) == 32.5  # 65,536 x 248,320 x 2 B
    assert round(items["selected logits [N x V]"] / GB, 1) == 12.2  # 24,576 x 248,320 x 2 B
    assert round(items["KL softmax / log-softmax / product [N x V]"] / GB) == 37  # "about three such tensors (36 GB)"
    assert not naive.fits


def test_baseline_fits_and_bigger_runs_get_a_recommendation():
    cfg = load_config(["baseline-v6"])
    assert plan_for_config(cfg).fits
    big = plan_for_config(cfg, gpu="l40s")
    assert not big.fits
    text = render_text(big)
    assert "DOES NOT FIT" in text and "the target's weights (" in text and "do not fit one" in text
    assert "capture its features with vLLM over 2 GPUs" in text  # 51 GB of bf16 weights, 70% of 48 GB each
    more = plan_for_config(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_anchors": 4096})}))
    assert not more.fits and any("largest that fits: data.max_anchors=" in r for r in more.recommendations)


def test_planner_follows_the_config():
    cfg = load_config(["ddtree-experiment"])
    w = make_plan(
        load_target_shape("qwen3.6-27b"),
        F.Workload(seq_len=65536, max_anchors=1024, block_size=24),
        Topology(memory=int(100 * GB), device_name="x", target_gpus=7),
    ).workload
    base = plan_for_config(cfg).devices[-1].peak
    more = (
        plan_for_config(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_anchors": 1536})}))
        .devices[-1]
        .peak
    )
    assert more > base and w.queries == 24_576
    fp32 = plan_for_config(cfg.model_copy(update={"train": cfg.train.model_copy(update={"dtype": "float32"})}))
    assert fp32.devices[-1].peak > base


# -- command line --------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    """``dflash-train plan ARGV`` through ``dflash_trainer.cli.main``: (exit status, stdout, stderr)."""
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_command_text_and_json(capsys):
    code, out, _ = run_cli(capsys, "--config", "ddtree-experiment")
    assert code == 0
    assert "target GPU (x7)" in out and "drafter GPU" in out and "verdict: FITS" in out
    code, out, _ = run_cli(capsys, "--config", "ddtree-experiment", "--json")
    data = json.loads(out)
    assert data["fits"] and data["workload"]["activation_checkpointing"]
    drafter = data["devices"][-1]
    assert drafter["total_bytes"] == drafter["tensor_peak_bytes"] + drafter["runtime_bytes"] + drafter["margin_bytes"]
    peak_items = sum(i["bytes"] for i in drafter["items"] if i["at_peak"])
    assert peak_items == drafter["tensor_peak_bytes"]
    code, out, _ = run_cli(
        capsys,
        "--target",
        "qwen3-8b",
        "--gpu",
        "h100",
        "--target-gpus",
        "3",
        "--set",
        "data.seq_len=32768",
        "--set",
        "drafter.attention_backend=flex",
        "--naive",
    )
    assert code == 0 and "WITHOUT this project's fixes" in out


# Qwen3-235B-A22B's config (its shapes only): 470 GB of bf16 weights, more than any one GPU
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}


def test_a_target_larger_than_one_gpu_gets_a_vllm_layout_and_the_window_its_disk(capsys, tmp_path):
    """The vLLM layout: the fewest power-of-two GPUs holding the weights within 70% of each (470 GB:
    8 of 96 GB, 2 of 400 GB), the drafter alone from the cache; capture vs drafter tokens/s; and a
    window of N shards prices N shards (one 3.2 GB row per 1 GiB shard here) instead of the cache."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_235B))
    argv = [
        "--config",
        "ddtree-experiment",
        "--target",
        str(tmp_path / "config.json"),
        "--set",
        "data.feature_window=8",
    ]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and "DOES NOT FIT: target GPU" in out
    assert "capture its features with vLLM over 8 GPUs (capture.vllm.tensor_parallel_size=8," in out
    assert "the drafter GPU alone peaks at" in out and "GB and fits" in out
    assert "with vLLM capturing" in out and "one server of 8 GPUs" in out
    code, out, _ = run_cli(capsys, *argv, "--gpu", "400")
    assert "capture its features with vLLM over 2 GPUs" in out
    code, out, _ = run_cli(capsys, *argv, "--json")
    cap = json.loads(out)["capture"]
    per_row = cap["bytes_per_row"][cap["storage_dtype"]]
    assert per_row > 1 << 30 and cap["window_bytes"] == 8 * per_row  # capture.shard_bytes 1 GiB: one row per shard
    assert f"at most {8 * per_row / 1e9:,.1f} GB of training shards on disk" in run_cli(capsys, *argv)[1]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--config", "ddtree-experiment", "--gpu", "rtx9000"], "unknown GPU 'rtx9000'"),
        (["--config", "ddtree-experiment", "--gpu", "0"], "GPU memory must be > 0"),
        (["--config", "ddtree-experiment", "--target", "qwen9"], "no config.json"),
        (["--config", "ddtree-experiment", "--target-gpus", "-1"], "--target-gpus must be >= 0"),
        (["--config", "ddtree-experiment", "--set", "data.max_anchors=0"], "data.max_anchors"),
        (["--config", "ddtree-experiment", "--set", "topology.gpu=rtx9000"], "rtx-pro-6000"),
        (["--set", "target.path=null"], "no target to plan for"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, needle):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and needle in err, err


def test_bad_config_json_names_the_field(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "vocab_size": 100}))
    code, _, err = run_cli(capsys, "--target", str(tmp_path))
    assert code == 2 and "'hidden_size'" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": -8,
                "num_hidden_layers": 4,
                "vocab_size": 100,
                "intermediate_size": 8,
                "num_attention_heads": 2,
            }
        )
    )
    code, _, err = run_cli(capsys, "--target", str(tmp_path / "config.json"))
    assert code == 2 and "'hidden_size' must be a positive integer" in err
    with pytest.raises(UserError, match="unknown GPU"):
        gpu_memory("tpu")
    with pytest.raises(UserError, match="must hold a JSON object"):
        TargetShape.from_config([], "x")


# -- preflight -----------------------------------------------------------------------------------


def _tiny_cfg(*extra):
    return load_config(["tiny-demo"], ["data.train_files=[x.jsonl]", *extra])


def _topo(gb):
    return Topology(memory=int(gb * GB), device_name="test RAM", device="cpu", cpu_threads=2)


def test_preflight_derives_the_loss_chunk_and_refuses_what_does_not_fit():
    out = io.StringIO()
    cfg = preflight(_tiny_cfg(), topology=_topo(16), out=out)
    rows = 32 * 7  # max_anchors x (block_size - 1)
    assert cfg.loss.chunk_size == rows and "preflight: predicted peak" in out.getvalue()
    assert preflight(_tiny_cfg("loss.chunk_size=16"), topology=_topo(16), out=io.StringIO()).loss.chunk_size == 16

    out = io.StringIO()
    with pytest.raises(UserError, match="topology.preflight=false") as err:
        preflight(_tiny_cfg("data.max_anchors=256"), topology=_topo(0.14), out=out)
    assert "\n" not in str(err.value)
    assert "DOES NOT FIT" in out.getvalue() and "largest that fits: data.max_anchors=" in out.getvalue()
    out = io.StringIO()
    cfg = preflight(_tiny_cfg("topology.preflight=false"), topology=_topo(0.05), out=out)
    assert "running anyway" in out.getvalue() and cfg.loss.chunk_size >= 1


def test_train_runs_the_preflight_first(tmp_path, monkeypatch):
    """run_training refuses before loading the target or the data (a tiny budget via the RAM probe)."""
    from dflash_trainer.commands import train as run_train
    from dflash_trainer.planner import preflight as pf

    monkeypatch.setattr(pf, "available_ram", lambda: int(0.01 * GB))
    cfg = load_config(["tiny-demo"], [f"output_dir={tmp_path / 'run'}", "data.train_files=[missing.jsonl]"])
    with pytest.raises(UserError, match="preflight"):
        run_train.run_training(cfg, progress=False)


# -- the remedy ----------------------------------------------------------------------------------


def test_activation_checkpointing_keeps_gradients_identical():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_trainer.config import DrafterConfig
    from dflash_trainer.data.blocks import build_blocks
    from dflash_trainer.data.packing import doc_ids_from_positions

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
        )
    ).double()
    grads = []
    for ckpt in (False, True):
        dc = DrafterConfig(
            num_layers=3, block_size=4, sliding_window_layers=[0], sliding_window=5, activation_checkpointing=ckpt
        )
        spec = DrafterSpec.from_target(target.config, dc, num_features=2, mask_token_id=3)
        assert spec.activation_checkpointing is ckpt
        torch.manual_seed(1)
        d = DFlashDrafter(spec, target.get_input_embeddings(), target.get_output_embeddings().weight).double().train()
        positions = torch.cat([torch.arange(20), torch.arange(12)])
        ids = torch.randint(4, 64, (32,), generator=torch.Generator().manual_seed(2))
        blocks = build_blocks(
            ids,
            positions,
            torch.ones(32, dtype=torch.long),
            torch.tensor([3, 9, 22]),
            block_size=4,
            mask_token_id=3,
            gamma=4.0,
        )
        masks = d.build_masks(blocks.anchors, blocks.doc_ids, doc_ids_from_positions(positions), "dense")
        feats = torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        d(blocks.input_ids, blocks.position_ids, feats, positions, masks).square().sum().backward()
        grads.append([p.grad.clone() for p in d.parameters()])
    for a, b in zip(*grads):  # the backward recomputes the same forward, op for op: equal bit for bit
        assert torch.equal(a, b)


def test_seed_plan_renders_its_breakdown():
    plan = plan_for_config(load_config(["ddtree-experiment"]))
    text = render_text(plan)
    for name in (
        "target weights",
        "target activations (body-only forward)",
        "captured hidden states",
        "drafter weights (fp32)",
        "gradients (fp32)",
        "optimizer states (Muon + AdamW, fp32)",  # the default train.optimizer
        "drafter activations (saved for backward)",
        "fused loss workspace",
        "allocator margin",
    ):
        assert name in text
    data = render_json(plan)
    assert json.dumps(data)  # serializable
    assert data["loss_chunk"] == plan.chunk <= 1024
    w = replace(plan.workload, max_anchors=2048)
    assert w.queries == 2048 * 24
    assert sys.getsizeof(text) > 0


# -- throughput of the disaggregated topology ------------------------------------------------------


def test_throughput_model_names_the_bottleneck_and_the_best_split():
    from dflash_trainer.planner.throughput import best_split, bytes_per_row, throughput

    for preset, bottleneck in (("baseline-v6", "target"), ("ddtree-experiment", "drafter")):
        cfg = load_config([preset], ["target.path=null", "topology.target_model=qwen3.6-27b"])
        plan = plan_for_config(cfg)
        tp = plan.throughput
        assert tp is not None and tp["gpu"] == "rtx-pro-6000"
        now, best = tp["as_launched"], tp["best_split"]
        assert (now["target_ranks"], now["drafter_ranks"]) == (7, 1) and now["bottleneck"] == bottleneck
        assert best["target_ranks"] + best["drafter_ranks"] == 8 and best["tokens_per_s"] >= now["tokens_per_s"]
        assert "throughput model" in render_text(plan) and render_json(plan)["throughput"] == tp
    # the seed's context features are [65,536, 5 x 5,120] bf16 = 3.36 GB per row (DESIGN.md 4b)
    cfg = load_config(["ddtree-experiment"], ["target.path=null", "topology.target_model=qwen3.6-27b"])
    shape, w = load_target_shape("qwen3.6-27b"), plan_for_config(cfg).workload
    context, teacher, ints = 65_536 * 5 * 5_120 * 2, 24_576 * 5_120 * 2, 8 * (3 * 65_536 + 1_024) + 80
    assert (w.seq_len, w.max_anchors * w.block_size) == (65_536, 24_576)
    assert bytes_per_row(shape, w) == context + teacher + ints  # integers: exact
    ids = [1, 16, 31, 46, 61]
    one = throughput(shape, w, ids, 0, 1, peak_flops=1e15, link_bytes_per_s=1e11)
    split = throughput(shape, w, ids, 3, 1, peak_flops=1e15, link_bytes_per_s=1e11)
    assert one.rows_per_s == pytest.approx(1 / (split.target_s_per_row + split.drafter_s_per_row))
    assert split.rows_per_s == pytest.approx(
        min(3 / split.target_s_per_row, 1 / split.drafter_s_per_row, 1e11 / split.bytes_per_row)
    )
    slow_link = throughput(shape, w, ids, 7, 1, peak_flops=1e15, link_bytes_per_s=1e8)
    assert slow_link.bottleneck == "link"
    assert best_split(shape, w, ids, 8, peak_flops=1e15, link_bytes_per_s=1e11).tokens_per_s == max(
        throughput(shape, w, ids, t, 8 - t, peak_flops=1e15, link_bytes_per_s=1e11).tokens_per_s for t in range(1, 8)
    )


def test_plan_prices_the_transfer_buffers_of_the_topology():
    base = ["target.path=null", "topology.target_model=qwen3.6-27b"]
    two = plan_for_config(load_config(["ddtree-experiment"], base))
    four = plan_for_config(load_config(["ddtree-experiment"], [*base, "topology.prefetch=4"]))
    item = "next row's features (in flight)"

    def size(plan, role_word, name):
        dev = next(d for d in plan.devices if role_word in d.role)
        return next(i.bytes for i in dev.items if i.name == name)

    assert size(four, "drafter", item) == 2 * size(two, "drafter", item) > 0
    assert size(four, "target", "rows queued for sending") == 2 * size(two, "target", "rows queued for sending") > 0


def test_long_rows_with_thousands_of_anchors_are_priced():
    """ModelOpt's long-context fine-tune: 32K-token rows, 4,096 anchors x block 16 (65,536 queries over
    98,304 keys; anchors are distinct positions whose blocks overlap). The 27B plan prices it, fits, and
    its headroom counts anchors up to L - B + 1, not L / B (2,048 here: fewer than the run asks for)."""
    cfg = load_config(["ddtree-experiment"], ["data.seq_len=32768", "data.max_anchors=4096", "drafter.block_size=16"])
    plan = plan_for_config(cfg)
    assert plan.workload.queries == 65536 and plan.workload.keys == 32768 + 65536
    assert plan.fits
    (headroom,) = [r for r in plan.recommendations if r.startswith("headroom")]
    assert "every position" not in headroom
    assert int(headroom.split("max_anchors=")[1].split()[0].replace(",", "")) > 4096
    items = {}
    for anchors in (4096, 8192):
        p = plan_for_config(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_anchors": anchors})}))
        items[anchors] = {i.name: i.bytes for i in p.devices[-1].items}
    name = "drafter activations (saved for backward)"
    assert items[8192][name] > 1.5 * items[4096][name]  # the queries and the keys both grow
    short = load_config(["tiny-demo"], ["data.seq_len=512", "data.max_anchors=500", "drafter.block_size=8"])
    (headroom,) = [r for r in plan_for_config(short, gpu="h200").recommendations if r.startswith("headroom")]
    assert headroom == "headroom: even an anchor at every position fits (505 x block 8)"
