"""DSpark's speculators export checked by speculators' own ``DSparkDraftModel`` (separate venv, as the
serving-parity tests do): its block logits (with the Markov bias) and confidence logits equal ours
within 1e-3 on held-out rows; formats with no such heads refuse with one line."""

import json

import pytest
import torch
from external_runner import run_script
from external_venvs import speculators_python
from safetensors.torch import load_file, save_file
from test_export import ANCHORS, bf16_rounded, float64_parity_bound, float64_target

from dflash_trainer.config.schema import DrafterConfig
from dflash_trainer.drafter_folder import load_drafter, save_drafter
from dflash_trainer.errors import UserError
from dflash_trainer.export.formats import export_checkpoint
from dflash_trainer.model.drafter import DrafterSpec
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.variants import make_drafter, variant_of

SCRIPT = "speculators_dspark_logits.py"  # in tests/external


def make_dspark_checkpoint(model, tok, root, name, **settings):
    target = TargetModel(model)
    cfg = DrafterConfig(num_layers=2, block_size=8, variant="dspark", dspark={"markov_rank": 16, **settings})
    spec = DrafterSpec.from_target(
        model.config, cfg, num_features=len(target.layer_ids), mask_token_id=tok.mask_token_id
    )
    torch.manual_seed(0)
    drafter = make_drafter(spec, target.embed_tokens, target.lm_head_weight)
    for p in drafter.parameters():
        p.data.normal_(0, 0.05 if p.dim() > 1 else 1.0)
    drafter.markov_head.markov_w1.weight.data.normal_(0, 1.0)  # a bias that moves the argmax
    return save_drafter(drafter, root / name, target=target, target_path="tiny")


def our_block_logits(drafter, ids, feats, anchors):
    """Training layout over the given anchors: ``(logits [n, B, V], confidence [n, B], logits without
    the Markov bias [n, B, V])`` with the
    ground-truth previous tokens (teacher forcing, as speculators' DSparkDraftModel.forward)."""
    from dflash_trainer.data.blocks import build_blocks
    from dflash_trainer.data.packing import doc_ids_from_positions

    spec, variant = drafter.spec, variant_of(drafter.spec)
    b, shift = spec.block_size, variant.label_shift(spec)
    pos = torch.arange(ids.numel())
    blocks = build_blocks(
        ids, pos, torch.ones_like(ids), anchors, block_size=b + shift, mask_token_id=spec.mask_token_id, gamma=1.0
    )
    masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc_ids_from_positions(pos), "dense")
    with torch.no_grad():
        hidden = drafter(blocks.input_ids[:, :b], blocks.position_ids[:, :b], feats, pos, masks, "dense")
        prev = variant.batch_extras(spec, ids, blocks.anchors)["prev_ids"]
        feat, conf = variant.head_inputs(drafter, prev, hidden)
        plain = hidden @ drafter.lm_head_weight.T
        logits = plain + feat @ drafter.markov_head.markov_w2.weight.T
    n = anchors.numel()
    return logits.view(n, b, -1), conf.view(n, b), plain.view(n, b, -1)


SETTINGS = {
    "vanilla": {},
    "gated-no-anchor": {"markov_head_type": "gated", "sample_from_anchor": False},
    "rnn-conf-hidden-only": {"markov_head_type": "rnn", "confidence_head_with_markov": False},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, tok = load_tiny_target()
    root = tmp_path_factory.mktemp("dspark-export")
    text = load_split("held_out", limit=2)[1].text[:3000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    feats = TargetModel(model).features(ids, need_teacher=False).context
    ckpts = {name: make_dspark_checkpoint(model, tok, root, name, **kw) for name, kw in SETTINGS.items()}
    target64 = float64_target(model)
    return {"model": model, "tok": tok, "root": root, "ids": ids, "feats": feats, "ckpts": ckpts, "target64": target64}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculators_dspark_computes_our_logits_and_confidence(setup, name):
    root, python = setup["root"], speculators_python()
    out = export_checkpoint(setup["ckpts"][name], root / f"spec-{name}", "speculators", target_model=setup["model"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["speculators_config"]["algorithm"] == "dspark"
    from_anchor = SETTINGS[name].get("sample_from_anchor", True)
    drafts = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert drafts == (8 if from_anchor else 7)
    anchors = torch.tensor(ANCHORS)
    save_file(  # speculators runs in the inputs' dtype: float64, as ours below
        {"features": setup["feats"].double().contiguous(), "input_ids": setup["ids"], "anchors": anchors},
        str(root / f"in-{name}.safetensors"),
    )
    run_script(python, SCRIPT, out, root / f"in-{name}.safetensors", root / f"out-{name}.safetensors", cwd=root)
    theirs = load_file(str(root / f"out-{name}.safetensors"))
    drafter = bf16_rounded(load_drafter(setup["ckpts"][name], setup["target64"])[0]).double()
    logits, conf, plain = our_block_logits(drafter, setup["ids"], setup["feats"].double(), anchors)
    slots = slice(0 if from_anchor else 1, None)  # speculators' anchor slot is not a draft without sample_from_anchor
    diff = (theirs["logits"][:, slots] - logits[:, slots]).abs().max().item()
    conf_diff = (theirs["confidence"][:, slots] - conf[:, slots]).abs().max().item()
    print(f"{name}: max |logit diff| {diff:.2e}, max |confidence logit diff| {conf_diff:.2e}")
    # float64 on both sides: rounding alone, the Markov and confidence heads as one more layer
    bound = float64_parity_bound(drafter.spec, logits[:, slots], extra_layers=1)
    conf_bound = float64_parity_bound(drafter.spec, conf[:, slots], extra_layers=1)
    assert diff <= bound and conf_diff <= conf_bound, (bound, conf_bound)
    # the Markov bias is really part of it: without it the logits are far from speculators'
    assert (theirs["logits"][:, slots] - plain[:, slots]).abs().max().item() > 0.1


def test_zlab_refuses_a_dspark_drafter_in_one_line(setup, tmp_path):
    with pytest.raises(UserError, match="no Markov or confidence head") as err:
        export_checkpoint(setup["ckpts"]["vanilla"], tmp_path / "z", "zlab")
    assert "\n" not in str(err.value)


def _walk(drafter, ids, feats, anchor):
    """``(walk logits [D, V], drafts [D], confidence [D] or None)`` of the block at ``anchor``, as decoding drafts it."""
    pos = torch.arange(anchor)
    with torch.no_grad():
        hidden = drafter.draft_block(int(ids[anchor]), anchor, drafter.context_cache(feats[:anchor], pos))
        return variant_of(drafter.spec).walk(drafter, hidden[None], ids[anchor : anchor + 1])


@pytest.mark.parametrize("name", ["vanilla", "gated-no-anchor"])
def test_our_loader_and_export_check_read_a_dspark_folder(setup, name, tmp_path):
    from dflash_trainer.export.formats import check_export
    from dflash_trainer.export.layouts import load_any_drafter

    ckpt = setup["ckpts"][name]
    out = export_checkpoint(ckpt, tmp_path / "spec", "speculators", target_model=setup["model"])
    target = TargetModel(setup["model"])
    loaded, meta = load_any_drafter(out, target)
    assert loaded.spec.variant == "dspark" and meta["format"] == "speculators"
    want = load_drafter(ckpt, target)[0].spec.variant_options
    for key in ("markov_rank", "markov_head_type", "sample_from_anchor", "confidence_head"):
        assert loaded.spec.variant_options[key] == want[key]
    reference = bf16_rounded(load_drafter(ckpt, target)[0])
    for a in ANCHORS:
        got, want = _walk(loaded, setup["ids"], setup["feats"], a), _walk(reference, setup["ids"], setup["feats"], a)
        # the same weights (bf16 values, exact in fp32) through the same modules: the same bits
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    report = check_export(out)
    assert report.problems == [], report.problems
    assert report.max_logit_diff is not None and report.max_logit_diff <= 1e-3


def test_export_check_catches_a_broken_dspark_folder(setup, tmp_path):
    from dflash_trainer.export.formats import check_export

    out = export_checkpoint(setup["ckpts"]["vanilla"], tmp_path / "spec", "speculators", target_model=setup["model"])
    cfg = json.loads((out / "config.json").read_text())
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7  # DFlash's count, not DSpark's 8
    cfg["markov_rank"] = 32  # the weights hold rank 16
    (out / "config.json").write_text(json.dumps(cfg))
    problems = check_export(out).problems
    assert "speculative_tokens 7 does not equal block_size (sample_from_anchor) = 8" in problems
    assert any(p.startswith("markov_head.markov_w1.weight is ") and "the config gives" in p for p in problems)
    # the Markov bias computes the drafts: a W2 that is not the checkpoint's fails the numeric check
    cfg["markov_rank"], cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 16, 8
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(out / "model.safetensors"))
    weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"] * 2
    save_file(weights, str(out / "model.safetensors"))
    report = check_export(out)
    assert len(report.problems) == 1 and report.problems[0].startswith("block logits vs checkpoint vanilla: max |diff|")


def test_a_dspark_folder_with_a_bad_head_setting_is_one_line(setup, tmp_path):
    from dflash_trainer.export.layouts import read_drafter_folder

    out = export_checkpoint(setup["ckpts"]["vanilla"], tmp_path / "spec", "speculators", target_model=setup["model"])
    cfg = json.loads((out / "config.json").read_text())
    cfg["markov_head_type"] = "lstm"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="markov_head_type 'lstm'") as err:
        read_drafter_folder(out)
    assert "\n" not in str(err.value)
