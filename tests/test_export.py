"""Export for serving: zlab and speculators formats, round trips, refusals, and the check command."""

import copy
import json
import subprocess
import sys

import pytest
import tolerances
import torch
from cli_runs import in_process
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from dflash_trainer.commands.train import warn_unservable
from dflash_trainer.config import DrafterConfig, RunConfig
from dflash_trainer.drafter_folder import load_drafter, save_drafter
from dflash_trainer.errors import UserError
from dflash_trainer.export.formats import (
    EXPORT_INFO,
    SMOKE_TOLERANCE,
    check_export,
    export_checkpoint,
    load_export,
)
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target, tiny_target_path
from dflash_trainer.tiny_target.corpus import load_split

ANCHORS = [9, 50, 101, 140]
# The drafters exported here: the defaults, sliding windows (causal inside the block), and a hooked
# layer equal to the 8-layer tiny target's last layer.
VARIANTS = {
    "plain": ({}, None),
    "windowed": ({"sliding_window_layers": [0], "sliding_window": 16, "causal_in_block_sliding": True}, None),
    "last-layer": ({}, [1, 3, 5, 7]),
}


def make_checkpoint(model, tok, root, name, drafter_kwargs, layer_ids):
    target = TargetModel(model, layer_ids=layer_ids)
    cfg = DrafterConfig(num_layers=3, block_size=8, **drafter_kwargs)
    spec = DrafterSpec.from_target(
        model.config, cfg, num_features=len(target.layer_ids), mask_token_id=tok.mask_token_id
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
    for p in drafter.parameters():
        p.data.normal_(0, 0.05 if p.dim() > 1 else 1.0)
    return save_drafter(drafter, root / name, target=target, target_path="tiny")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tok = load_tiny_target()
    root = tmp_path_factory.mktemp("export")
    ckpts = {name: make_checkpoint(model, tok, root, name, kw, ids) for name, (kw, ids) in VARIANTS.items()}
    target = TargetModel(model)
    text = load_split("held_out", limit=2)[1].text[:3000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    feats = target.features(ids, need_teacher=False).context
    return {
        "target": target,
        "tok": tok,
        "ckpt": ckpts["plain"],
        "ckpts": ckpts,
        "root": root,
        "ids": ids,
        "feats": feats,
    }


def block_logits(drafter, s, feats=None):
    """Per-slot logits of each anchor's block, served one block at a time."""
    feats = s["feats"] if feats is None else feats
    out = []
    for a in ANCHORS:
        cache = drafter.context_cache(feats[:a], torch.arange(a))
        out.append(drafter.block_logits(drafter.draft_block(int(s["ids"][a]), a, cache)))
    return torch.stack(out)


def bf16_rounded(drafter):
    for p in drafter.parameters():
        p.data = p.data.bfloat16().float()
    return drafter


def float64_target(model, layer_ids=None) -> TargetModel:
    """The target (its embedding and head, which the drafter shares) in float64, for float64 references."""
    return TargetModel(copy.deepcopy(model).double(), layer_ids=layer_ids)


def float64_parity_bound(spec, logits: torch.Tensor, extra_layers: int = 0) -> float:
    """How far another implementation's float64 block logits may lie from ours (``logits``): rounding
    alone, ``tolerances.float64_forward_error`` of the drafter's layers and its head (one more layer),
    the widest reduction the vocabulary's or the MLP's (5 H: gate, up and down of width <= 4 H), relative
    to the logits' magnitude; ``extra_layers`` for a variant's heads after the head (DSpark's Markov and
    confidence heads, DFlash2's selector). A wrong mask, window, position or weight moves them by 1e-2
    or more."""
    inner = max(spec.vocab_size, 5 * spec.hidden_size)
    layers = spec.num_layers + 1 + extra_layers
    return tolerances.float64_forward_error(layers=layers, inner=inner) * logits.abs().max().item()


def run_process(*args):
    """``dflash-train ARGS`` as its own process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, timeout=300
    )


def run_cli(*args):
    """``dflash-train ARGS`` in this process (the export itself runs as a process in
    test_export_round_trips_through_our_loader's first case): tests/cli_runs.py."""
    return in_process(*args)


def test_checkpoint_round_trip(setup):
    drafter, meta = load_drafter(setup["ckpt"], setup["target"])
    assert meta["target"]["layer_ids"] == [1, 2, 3, 4, 5] and meta["spec"]["block_size"] == 8
    again, _ = load_drafter(setup["ckpt"], setup["target"])
    assert torch.equal(block_logits(drafter, setup), block_logits(again, setup))


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export_round_trips_through_our_loader(setup, fmt):
    out = setup["root"] / fmt
    # the export as a user runs it, its own process, for the first format; the second in this process
    # (tests/cli_runs.py: the same command, without an interpreter start and torch's import)
    run = run_process if fmt == "zlab" else run_cli
    result = run("export", "--format", fmt, str(setup["ckpt"]), str(out))
    assert result.returncode == 0, result.stderr
    cfg = json.loads((out / "config.json").read_text())
    tiny = str(tiny_target_path().resolve())  # a folder the serving stack can load, never "tiny"
    if fmt == "zlab":
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
        assert cfg["dflash_config"] == {
            "mask_token_id": setup["tok"].mask_token_id,
            "target_layer_ids": [1, 2, 3, 4, 5],
            "causal_in_block_sliding": False,
            "target_model_path": tiny,
            "target_transforms": {"embedding_scale": 1.0, "logit_scale": 1.0, "logit_softcap": None},
        }
        assert cfg["num_target_layers"] == 8 and cfg["layer_types"] == ["full_attention"] * 3
    else:
        assert cfg["speculators_model_type"] == "dflash"
        assert cfg["aux_hidden_state_layer_ids"] == [2, 3, 4, 5, 6]  # z-lab ids + 1
        assert cfg["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7}]
        assert cfg["speculators_config"]["verifier"] == {"name_or_path": tiny, "architectures": ["Qwen3ForCausalLM"]}
    assert "dflash_trainer_mismatches" not in cfg
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["trained_layer_ids"] == [1, 2, 3, 4, 5] and info["allowed_mismatches"] == []
    assert "How the serving stack reads this export" in (out / "README.md").read_text()
    weights = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert ("embed_tokens.weight" in weights) == (fmt == "speculators") == ("lm_head.weight" in weights)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.2.mlp.down_proj.weight"} <= set(weights)
    loaded = load_export(out, setup["target"])
    reference = bf16_rounded(load_drafter(setup["ckpt"], setup["target"])[0])
    # the same weights (bf16 values, exact in fp32) through the same module: the same bits
    assert torch.equal(block_logits(loaded, setup), block_logits(reference, setup))
    report = check_export(out)
    assert report.problems == [], report.problems
    assert report.max_logit_diff is not None and report.max_logit_diff <= SMOKE_TOLERANCE


def test_zlab_export_loads_with_transformers_trust_remote_code(setup):
    out = setup["root"] / "zlab-hf"
    export_checkpoint(setup["ckpt"], out, "zlab")
    # z-lab's model code and ours on the same (bf16-valued) weights, both in float64: another
    # implementation of the same network differs by rounding alone (tests/tolerances.py)
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float64, local_files_only=True).eval()
    assert type(hf).__name__ == "DFlashDraftModel"
    reference = bf16_rounded(load_drafter(setup["ckpt"], setup["target"])[0]).double()
    embed = setup["target"].embed_tokens.weight.detach().double()
    head = setup["target"].lm_head_weight.detach().double()
    feats = setup["feats"].double()
    spec = reference.spec
    mask_id = setup["tok"].mask_token_id
    for a in ANCHORS:
        block = torch.tensor([int(setup["ids"][a])] + [mask_id] * 7)
        with torch.no_grad():
            cache = reference.context_cache(feats[:a], torch.arange(a))
            expected = reference.draft_block(int(setup["ids"][a]), a, cache).to(head.dtype) @ head.T
            hidden = hf(
                noise_embedding=embed[block][None],
                target_hidden=feats[None, :a],
                position_ids=torch.arange(a + 8)[None],
            )
        logits = hidden[0] @ head.T
        bound = float64_parity_bound(spec, expected)
        assert (logits - expected).abs().max().item() <= bound, f"anchor {a}"


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        (
            "windowed",
            "cannot export as zlab: drafter.sliding_window_layers [0] (W=16, causal in the block): z-lab's "
            "DFlashDraftModel does not apply this window (its sdpa/eager attention ignores sliding_window); "
            "export --format speculators, or load the zlab export with its shipped modeling_dflash.py "
            "(trust_remote_code) (or --allow-mismatch)",
        ),
        (
            "last-layer",
            "cannot export as zlab: target.layer_ids contains 7, the target's last layer: z-lab's code reads "
            "hidden_states[8], which transformers returns after the final norm, but training hooked the "
            "pre-norm output; export --format speculators (vLLM captures it pre-norm), or train without "
            "layer 7 (or --allow-mismatch)",
        ),
    ],
)
def test_zlab_export_refuses_what_zlab_cannot_serve(setup, variant, expected, tmp_path):
    ckpt = str(setup["ckpts"][variant])
    refused = run_cli("export", "--format", "zlab", ckpt, str(tmp_path / "refused"))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [f"dflash-train: error: {expected}"], (
        refused.stderr
    )
    assert not (tmp_path / "refused").exists()
    # The speculators format serves both as trained.
    export_checkpoint(ckpt, tmp_path / "spec", "speculators", target_model=setup["target"].model)
    # --allow-mismatch writes it, and says what differs in the README, config and export_info.json.
    export_checkpoint(ckpt, tmp_path / "allowed", "zlab", allow_mismatch=True)
    message = expected.removeprefix("cannot export as zlab: ").removesuffix(" (or --allow-mismatch)")
    readme = (tmp_path / "allowed" / "README.md").read_text()
    assert "## What differs from training (exported with --allow-mismatch)" in readme and message in readme
    assert json.loads((tmp_path / "allowed" / "config.json").read_text())["dflash_trainer_mismatches"] == [message]
    assert json.loads((tmp_path / "allowed" / EXPORT_INFO).read_text())["allowed_mismatches"] == [message]
    checked = run_cli("export", "--check", str(tmp_path / "allowed"))
    assert checked.returncode == 0, checked.stdout
    assert f"note: accepted at export: {message}" in checked.stdout


def test_last_layer_zlab_smoke_test_measures_the_post_norm_read(setup, tmp_path):
    """z-lab's extraction (transformers' hidden_states[8] for id 7) is what the numeric check feeds a
    zlab export: the accepted last-layer mismatch shows up in the block logits."""
    out = export_checkpoint(setup["ckpts"]["last-layer"], tmp_path / "z", "zlab", allow_mismatch=True)
    report = check_export(out)
    assert report.problems == [] and report.max_logit_diff > 0.1
    spec_out = export_checkpoint(
        setup["ckpts"]["last-layer"], tmp_path / "s", "speculators", target_model=setup["target"].model
    )
    assert check_export(spec_out).max_logit_diff <= SMOKE_TOLERANCE


def test_verifier_is_recorded_as_the_stack_resolves_it(setup, tmp_path):
    hub = export_checkpoint(
        setup["ckpt"],
        tmp_path / "hub",
        "speculators",
        target_model=setup["target"].model,
        verifier="some-org/some-model",
    )
    cfg = json.loads((hub / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "some-org/some-model"
    # Tests run offline: a hub name that is not in the cache cannot be loaded, and --check says so.
    problems = check_export(hub, smoke=False).problems
    assert len(problems) == 2 and problems[0].startswith(
        "verifier 'some-org/some-model' is neither a local model folder nor loadable from the Hugging Face hub"
    )
    assert problems[1] == "the export names no loadable target; pass --target PATH"
    assert check_export(hub, "tiny", smoke=False).problems == problems[:1]
    # What the export used to record: the config's target.path ("tiny"), which speculators cannot load.
    cfg["speculators_config"]["verifier"]["name_or_path"] = "tiny"
    (hub / "config.json").write_text(json.dumps(cfg))
    result = run_cli("export", "--check", str(hub))
    assert result.returncode == 1 and "problem: verifier 'tiny' is neither a local model folder" in result.stdout
    assert run_cli("export", "--check", str(hub), "--target", "tiny").returncode == 1  # --target does not mend it


def rewrite_weights(folder, change):
    weights = load_file(str(folder / "model.safetensors"))
    change(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_check_names_each_problem(setup, tmp_path):
    good = tmp_path / "good"  # its own export: the test does not lean on another test having run first
    export_checkpoint(setup["ckpt"], good, "speculators", target_model=setup["target"].model)
    assert run_cli("export", "--check", str(good)).returncode == 0
    bad = tmp_path / "bad"
    export_checkpoint(setup["ckpt"], bad, "speculators", target_model=setup["target"].model)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [4, 5, 6, 7, 9]  # an id past the 8-layer target
    cfg["mask_token_id"] = 0  # <|endoftext|>, not <|MASK|>
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 15
    (bad / "config.json").write_text(json.dumps(cfg))

    def shrink(w):
        w["layers.1.mlp.up_proj.weight"] = w["layers.1.mlp.up_proj.weight"][:-1]  # z-lab's loader rejects this
        w["norm.weight"] = w["norm.weight"].float()

    rewrite_weights(bad, shrink)
    result = run_cli("export", "--check", str(bad))
    assert result.returncode == 1
    lines = [line.removeprefix("problem: ") for line in result.stdout.splitlines() if line.startswith("problem: ")]
    assert lines == [
        "target layer ids [8] are outside the target's 0..7 (speculators ids are z-lab ids + 1: an off-by-one export?)",
        "aux_hidden_state_layer_ids [4, 5, 6, 7, 9] are not the ids the drafter was trained with ([2, 3, 4, 5, 6])",
        "mask token id 0 is not the target tokenizer's <|MASK|> (3)",
        "speculative_tokens 15 does not equal block_size - 1 = 7",
        "layers.1.mlp.up_proj.weight is (767, 256), the config gives (768, 256)",
        "norm.weight is F32, the config says bfloat16",
    ], result.stdout


@pytest.mark.parametrize(
    ("fmt", "ids", "expected"),
    [
        # In range but wrong: the speculators off-by-one (z-lab ids written as is) and reversed ids.
        (
            "speculators",
            [1, 2, 3, 4, 5],
            "aux_hidden_state_layer_ids [1, 2, 3, 4, 5] are not the ids the drafter was trained with ([2, 3, 4, 5, 6])",
        ),
        (
            "zlab",
            [5, 4, 3, 2, 1],
            "dflash_config.target_layer_ids [5, 4, 3, 2, 1] are not the ids the drafter was trained with ([1, 2, 3, 4, 5])",
        ),
    ],
)
def test_check_catches_in_range_but_wrong_layer_ids(setup, tmp_path, fmt, ids, expected):
    out = export_checkpoint(setup["ckpt"], tmp_path / fmt, fmt, target_model=setup["target"].model)
    cfg = json.loads((out / "config.json").read_text())
    if fmt == "speculators":
        cfg["aux_hidden_state_layer_ids"] = ids
    else:
        cfg["dflash_config"]["target_layer_ids"] = ids
    (out / "config.json").write_text(json.dumps(cfg))
    assert check_export(out).problems == [expected]


def test_check_smoke_test_catches_weights_that_do_not_compute_the_checkpoint(setup, tmp_path):
    out = export_checkpoint(setup["ckpt"], tmp_path / "z", "zlab")
    rewrite_weights(
        out, lambda w: w.update({"layers.0.mlp.down_proj.weight": w["layers.0.mlp.down_proj.weight"] * 1.5})
    )
    report = check_export(out)
    assert len(report.problems) == 1 and report.problems[0].startswith("block logits vs checkpoint plain: max |diff|")
    assert report.max_logit_diff > SMOKE_TOLERANCE


def test_mismatched_checkpoint_is_one_clear_error(setup):
    other = TargetModel(setup["target"].model, layer_ids=[1, 2, 3, 4, 6])
    with pytest.raises(
        UserError,
        match=r"does not match the target: layer ids \[1, 2, 3, 4, 5\] != the target's hooked ids \[1, 2, 3, 4, 6\]",
    ):
        load_drafter(setup["ckpt"], other)
    result = run_cli("export", "--format", "zlab", str(setup["root"] / "nothing"), str(setup["root"] / "x"))
    assert result.returncode == 2 and "is not a drafter checkpoint" in result.stderr


def test_training_warns_about_settings_the_named_formats_cannot_serve(capsys):
    windowed = RunConfig.model_validate(
        {
            "drafter": {"sliding_window_layers": [0], "sliding_window": 16},
            "target": {"layer_ids": [1, 3, 5, 7], "num_feature_layers": 4},
        }
    )
    lines = warn_unservable(windowed)  # default export.formats: both
    assert [line.split(": ")[1] for line in lines] == ["not servable in the zlab format"] * 2
    assert "drafter.sliding_window_layers [0] (W=16)" in lines[0] and "target.layer_ids contains 7" in lines[1]
    assert capsys.readouterr().err.splitlines() == lines
    windowed.export.formats = ["speculators"]
    assert warn_unservable(windowed) == []
    assert warn_unservable(RunConfig()) == []  # the defaults serve in both formats


def test_training_warns_that_speculators_serves_gemma_drafters_unscaled(tmp_path, capsys):
    from families import build_family

    build_family("gemma3", tmp_path / "gemma3")
    cfg = RunConfig.model_validate(
        {"target": {"path": str(tmp_path / "gemma3"), "layer_ids": [1, 2], "num_feature_layers": 2}}
    )
    lines = warn_unservable(cfg)
    assert (
        len(lines) == 1 and "not servable in the speculators format: the target scales its embeddings by 8" in lines[0]
    )
    cfg.export.formats = ["zlab"]
    assert warn_unservable(cfg) == []
