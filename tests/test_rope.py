"""drafter.rope_scaling (linear, YaRN): our frequencies against transformers' own ROPE_INIT_FUNCTIONS,
default RoPE unchanged bit for bit, carried into both export formats (our loader, transformers'
config reader, the shipped modeling file in float64, speculators' own model), refused when unknown."""

import json
import math
from dataclasses import replace

import pytest
import torch
from external_runner import run_script
from external_venvs import speculators_python
from safetensors.torch import load_file
from test_export import ANCHORS, bf16_rounded, block_logits, float64_parity_bound, float64_target, make_checkpoint
from transformers import AutoConfig, AutoModel, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_trainer.config import load_config
from dflash_trainer.drafter_folder import load_drafter
from dflash_trainer.errors import UserError
from dflash_trainer.export.formats import export_checkpoint, load_export
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.rope import rope_cos_sin, rope_inv_freq
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target
from dflash_trainer.tiny_target.corpus import load_split

EPS32 = torch.finfo(torch.float32).eps

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192, "truncate": False},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048, "attention_factor": 1.25},
]


def transformers_rope(scaling: dict, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    config = Qwen3Config(
        hidden_size=8 * head_dim,
        num_attention_heads=8,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={**scaling, "rope_theta": theta},
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
    return inv_freq.double(), float(scale)


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("head_dim,theta", [(64, 1e6), (128, 1e7), (32, 1e4)])
def test_frequencies_match_transformers(scaling, head_dim, theta):
    """transformers computes in float32: ``theta ** (2i / d)`` carries the exponent's rounding times
    ln(theta), the division, the factor and YaRN's ramp and blend a few roundings more, so the two agree
    within eps32 (ln theta + 8) of the unscaled frequency theta^(-2i/d); the cos/sin scale is a Python
    float on both sides. A wrong ramp boundary, factor or blend moves a frequency by 1e-2 or more."""
    ours, our_scale = rope_inv_freq(head_dim, theta, scaling)
    theirs, their_scale = transformers_rope(scaling, head_dim, theta)
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    bound = EPS32 * (math.log(theta) + 8) * base
    assert ((ours - theirs).abs() <= bound).all(), ((ours - theirs).abs() / base).max()
    # the scale, 0.1 ln(s) + 1 (or YaRN's mscale ratio), is a Python float on both sides: a few float64
    # roundings each (log within 1 ulp, then a product and a sum), under 1e-15 relative apart
    assert our_scale == pytest.approx(their_scale, rel=1e-15)
    assert ((ours - base).abs() > 1e-3 * base).any()  # the scaling really moved frequencies


def test_default_rope_is_unchanged_bit_for_bit():
    positions = torch.arange(5000)
    cos, sin = rope_cos_sin(positions, 64, 1e6, torch.float32)
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    emb = torch.cat([positions.double()[:, None] * inv] * 2, dim=-1)
    assert torch.equal(cos, emb.cos().float()) and torch.equal(sin, emb.sin().float())


def test_config_refuses_what_it_cannot_compute():
    with pytest.raises(UserError, match="original_max_position_embeddings"):
        load_config([], ["drafter.rope_scaling={rope_type: yarn, factor: 4}"])
    with pytest.raises(UserError, match="rope_type"):
        load_config([], ["drafter.rope_scaling={rope_type: longrope, factor: 4}"])
    with pytest.raises(UserError, match="factor"):
        load_config([], ["drafter.rope_scaling={rope_type: linear, factor: 0.5}"])


# -- exports -----------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}  # anchors reach 140


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    model, tok = load_tiny_target()
    root = tmp_path_factory.mktemp("rope")
    ckpts = {
        kind: make_checkpoint(model, tok, root, kind, {"rope_scaling": scaling}, None)
        for kind, scaling in (("yarn", YARN), ("linear", {"rope_type": "linear", "factor": 3.0}))
    }
    text = load_split("held_out", limit=2)[1].text[:3000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    target = TargetModel(model)
    feats = target.features(ids, need_teacher=False).context
    return {"model": model, "tok": tok, "root": root, "ckpts": ckpts, "ids": ids, "feats": feats, "target": target}


@pytest.mark.parametrize("kind", ["yarn", "linear"])
@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export_carries_the_scaling(scaled, kind, fmt):
    out = export_checkpoint(scaled["ckpts"][kind], scaled["root"] / f"{fmt}-{kind}", fmt, target_model=scaled["model"])
    trained = bf16_rounded(load_drafter(scaled["ckpts"][kind], scaled["target"])[0])
    assert trained.spec.rope_scaling["rope_type"] == kind
    loaded = load_export(out, scaled["target"])
    assert loaded.spec.rope_scaling == trained.spec.rope_scaling
    s = {"ids": scaled["ids"], "feats": scaled["feats"]}
    assert torch.equal(block_logits(loaded, s), block_logits(trained, s))
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    read = AutoConfig.for_model("qwen3", **{k: v for k, v in layer.items() if k != "model_type"})
    assert read.rope_parameters["rope_type"] == kind
    assert read.rope_parameters["factor"] == trained.spec.rope_scaling["factor"]


def test_zlab_modeling_file_computes_the_scaled_drafter_in_float64(scaled):
    out = export_checkpoint(scaled["ckpts"]["yarn"], scaled["root"] / "zlab-hf", "zlab")
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float64, local_files_only=True).eval()
    target64 = float64_target(scaled["model"])
    reference = bf16_rounded(load_drafter(scaled["ckpts"]["yarn"], target64)[0]).double()
    embed, head = target64.embed_tokens.weight.detach(), target64.lm_head_weight.detach()
    feats, ids, mask_id = scaled["feats"].double(), scaled["ids"], scaled["tok"].mask_token_id
    unscaled = []
    for a in ANCHORS:
        with torch.no_grad():
            cache = reference.context_cache(feats[:a], torch.arange(a))
            expected = reference.draft_block(int(ids[a]), a, cache) @ head.T
            block = torch.tensor([int(ids[a])] + [mask_id] * 7)
            logits = (
                hf(
                    noise_embedding=embed[block][None],
                    target_hidden=feats[None, :a],
                    position_ids=torch.arange(a + 8)[None],
                )[0]
                @ head.T
            )
        assert (logits - expected).abs().max().item() <= float64_parity_bound(reference.spec, expected), a
        unscaled.append(expected)
    # not vacuous: the same weights with default RoPE compute other logits
    plain = DFlashDrafter(replace(reference.spec, rope_scaling=None), reference.target_embed[0], head).double()
    plain.load_state_dict(reference.state_dict())
    a = ANCHORS[-1]
    with torch.no_grad():
        other = plain.draft_block(int(ids[a]), a, plain.context_cache(feats[:a], torch.arange(a))) @ head.T
    assert (other - unscaled[-1]).abs().max() > 1e-2


def test_speculators_builds_the_rotary_we_trained_with(scaled):
    """speculators' own DFlashDraftModel, loading the export, builds transformers' rotary embedding of
    our scaling: its rope type, its cos/sin scale, and frequencies within float32's rounding of ours."""
    python = speculators_python()
    for kind in ("yarn", "linear"):
        out = scaled["root"] / f"speculators-{kind}-probe"
        export_checkpoint(scaled["ckpts"][kind], out, "speculators", target_model=scaled["model"])
        run_script(python, "speculators_rope.py", out, scaled["root"] / f"rope-{kind}.safetensors")
        got = load_file(str(scaled["root"] / f"rope-{kind}.safetensors"))
        assert bytes(got["rope_type"].tolist()).decode() == kind
        spec = load_drafter(scaled["ckpts"][kind], scaled["target"])[0].spec
        ours, scale = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        base = rope_inv_freq(spec.head_dim, spec.rope_theta, None)[0]
        assert ((got["inv_freq"].double() - ours).abs() <= EPS32 * (math.log(spec.rope_theta) + 8) * base).all()
        assert got["attention_scaling"].item() == pytest.approx(scale, rel=1e-15)  # as in transformers' check above
