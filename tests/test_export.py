"""Export for serving: zlab and speculators formats, round trips, and the check command."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModel

from dflash_trainer.config import DrafterConfig
from dflash_trainer.errors import UserError
from dflash_trainer.export.formats import check_export, export_checkpoint, load_export
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.checkpoint import load_drafter, save_drafter

ANCHORS = [9, 50, 101, 140]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tok = load_tiny_target()
    target = TargetModel(model)
    cfg = DrafterConfig(num_layers=3, block_size=8, sliding_window_layers=[0], sliding_window=16)
    spec = DrafterSpec.from_target(model.config, cfg, num_features=5, mask_token_id=tok.mask_token_id)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
    for p in drafter.parameters():
        p.data.normal_(0, 0.05 if p.dim() > 1 else 1.0)
    root = tmp_path_factory.mktemp("export")
    ckpt = save_drafter(drafter, root / "ckpt", target=target, target_path="tiny")
    text = load_split("held_out", limit=2)[1].text
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    feats = target.features(ids, need_teacher=False).context
    return {"target": target, "tok": tok, "ckpt": ckpt, "root": root, "ids": ids, "feats": feats}


def block_logits(drafter, s):
    """Per-slot logits of each anchor's block, served one block at a time."""
    out = []
    for a in ANCHORS:
        cache = drafter.context_cache(s["feats"][:a], torch.arange(a))
        out.append(drafter.block_logits(drafter.draft_block(int(s["ids"][a]), a, cache)))
    return torch.stack(out)


def bf16_rounded(drafter):
    for p in drafter.parameters():
        p.data = p.data.bfloat16().float()
    return drafter


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_checkpoint_round_trip(setup):
    drafter, meta = load_drafter(setup["ckpt"], setup["target"])
    assert meta["target"]["layer_ids"] == [1, 2, 3, 4, 5] and meta["spec"]["block_size"] == 8
    again, _ = load_drafter(setup["ckpt"], setup["target"])
    assert torch.equal(block_logits(drafter, setup), block_logits(again, setup))


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export_round_trips_through_our_loader(setup, fmt):
    out = setup["root"] / fmt
    result = run_cli("export", "--format", fmt, str(setup["ckpt"]), str(out))
    assert result.returncode == 0, result.stderr
    cfg = json.loads((out / "config.json").read_text())
    if fmt == "zlab":
        assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
        assert cfg["dflash_config"] == {
            "mask_token_id": setup["tok"].mask_token_id,
            "target_layer_ids": [1, 2, 3, 4, 5],
            "causal_in_block_sliding": False,
            "target_model_path": "tiny",
            "target_transforms": {"embedding_scale": 1.0, "logit_scale": 1.0, "logit_softcap": None},
        }
        assert cfg["num_target_layers"] == 8
        assert (
            cfg["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
            and cfg["sliding_window"] == 16
        )
    else:
        assert cfg["speculators_model_type"] == "dflash"
        assert cfg["aux_hidden_state_layer_ids"] == [2, 3, 4, 5, 6]  # z-lab ids + 1
        assert cfg["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7}]
        assert cfg["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert ("embed_tokens.weight" in weights) == (fmt == "speculators") == ("lm_head.weight" in weights)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.2.mlp.down_proj.weight"} <= set(weights)
    loaded = load_export(out, setup["target"])
    reference = bf16_rounded(load_drafter(setup["ckpt"], setup["target"])[0])
    assert torch.allclose(block_logits(loaded, setup), block_logits(reference, setup), atol=1e-5)
    assert check_export(out) == []


def test_zlab_export_loads_with_transformers_trust_remote_code(setup):
    out = setup["root"] / "zlab-hf"
    export_checkpoint(setup["ckpt"], out, "zlab")
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32, local_files_only=True).eval()
    assert type(hf).__name__ == "DFlashDraftModel"
    reference = bf16_rounded(load_drafter(setup["ckpt"], setup["target"])[0])
    expected = block_logits(reference, setup)
    embed, head = setup["target"].embed_tokens, setup["target"].lm_head_weight
    mask_id = setup["tok"].mask_token_id
    for i, a in enumerate(ANCHORS):
        block = torch.tensor([int(setup["ids"][a])] + [mask_id] * 7)
        with torch.no_grad():
            hidden = hf(
                noise_embedding=embed(block)[None],
                target_hidden=setup["feats"][None, :a],
                position_ids=torch.arange(a + 8)[None],
            )
        logits = hidden[0] @ head.T
        assert torch.allclose(logits, expected[i], atol=1e-4), f"anchor {a}"


def test_check_names_each_problem(setup, tmp_path):
    good = setup["root"] / "speculators"
    assert run_cli("export", "--check", str(good)).returncode == 0
    bad = tmp_path / "bad"
    export_checkpoint(setup["ckpt"], bad, "speculators", target_model=setup["target"].model)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [4, 5, 6, 7, 9]  # an id past the 8-layer target
    cfg["mask_token_id"] = 0  # <|endoftext|>, not <|MASK|>
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 15
    (bad / "config.json").write_text(json.dumps(cfg))
    result = run_cli("export", "--check", str(bad))
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if line.startswith("problem: ")]
    assert len(lines) == 3, result.stdout
    assert "target layer ids [8] are outside the target's 0..7" in lines[0]
    assert "mask token id 0 is not the target tokenizer's <|MASK|> (3)" in lines[1]
    assert "speculative_tokens 15 does not equal block_size - 1 = 7" in lines[2]


def test_mismatched_checkpoint_is_one_clear_error(setup):
    other = TargetModel(setup["target"].model, layer_ids=[1, 2, 3, 4, 6])
    with pytest.raises(
        UserError,
        match=r"does not match the target: layer ids \[1, 2, 3, 4, 5\] != the target's hooked ids \[1, 2, 3, 4, 6\]",
    ):
        load_drafter(setup["ckpt"], other)
    result = run_cli("export", "--format", "zlab", str(setup["root"] / "nothing"), str(setup["root"] / "x"))
    assert result.returncode == 2 and "is not a drafter checkpoint" in result.stderr
