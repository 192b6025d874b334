"""DFlash2's exports checked by the reference implementations, each in its separate venv: speculators'
own ``DFlash2DraftModel`` loads the speculators export (``dflash2``) and computes our block unary
logits within 1e-3 and selects exactly our tokens on held-out rows; z-lab's own ``DFlash2DraftModel``
(PyPI ``dflash`` 0.1.0) loads the zlab export and its ``propose`` selects exactly our tokens. Our loader
and ``export --check`` read both folders back; a broken folder fails the check, a bad setting is one line."""

import json

import pytest
import torch
from external_runner import run_script
from external_venvs import speculators_python, zlab_python
from safetensors.torch import load_file, save_file
from test_export import bf16_rounded, float64_parity_bound, float64_target

from dflash_trainer.config.schema import DrafterConfig
from dflash_trainer.drafter_folder import load_drafter, save_drafter
from dflash_trainer.errors import UserError
from dflash_trainer.export.formats import check_export, export_checkpoint, zlab_features
from dflash_trainer.export.layouts import load_any_drafter, read_drafter_folder
from dflash_trainer.loss.logits import transform_logits
from dflash_trainer.model.drafter import DrafterSpec
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.variants import make_drafter, variant_of

ANCHORS = list(range(5, 150, 12))  # 13 blocks of 8 on a held-out row of 160 tokens: 91 selected tokens
SETTINGS = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}


def make_dflash2_checkpoint(model, tok, root):
    """A randomized dflash2 drafter: convolutions away from the identity, codebooks big enough that
    the selector moves the argmax (the fixture asserts it does)."""
    target = TargetModel(model)
    cfg = DrafterConfig(num_layers=2, block_size=8, variant="dflash2", dflash2=SETTINGS)
    spec = DrafterSpec.from_target(
        model.config, cfg, num_features=len(target.layer_ids), mask_token_id=tok.mask_token_id
    )
    torch.manual_seed(0)
    drafter = make_drafter(spec, target.embed_tokens, target.lm_head_weight)
    for p in drafter.parameters():
        p.data.normal_(0, 0.05 if p.dim() > 1 else 1.0)
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.data.normal_(0, 0.5)
            conv.base_kernel.data[:, 0] += 1.0
    selector = drafter.candidate_selector
    selector.predecessor_codebook.data.normal_(0, 1.0)
    selector.successor_codebook.data.normal_(0, 1.0)
    selector.hidden_projection.weight.data.normal_(0, 0.1)
    return save_drafter(drafter, root / "dflash2", target=target, target_path="tiny")


def run_external(python, script, *args):
    run_script(python, script, *args)
    out = load_file(str(args[-1]))
    assert "error" not in out, bytes(out["error"].tolist()).decode()
    return out


def training_layout(drafter, ids, feats, anchors):
    """``(unary logits [n, B, V], hidden [n, B, H])`` of the blocks at ``anchors``, all in one pass of
    the training layout (the convolutions' per-block view)."""
    from dflash_trainer.data.blocks import build_blocks
    from dflash_trainer.data.packing import doc_ids_from_positions

    spec, b = drafter.spec, drafter.spec.block_size
    pos = torch.arange(ids.numel())
    blocks = build_blocks(
        ids, pos, torch.ones_like(ids), anchors, block_size=b, mask_token_id=spec.mask_token_id, gamma=1.0
    )
    masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc_ids_from_positions(pos), "dense")
    with torch.no_grad():
        hidden = drafter(blocks.input_ids, blocks.position_ids, feats, pos, masks, "dense")
        unary = transform_logits(hidden @ drafter.lm_head_weight.T, **spec.logit_options)
    n = anchors.numel()
    return unary.view(n, b, -1), hidden.view(n, b, -1)


def served_walk(drafter, ids, feats, anchor):
    """``(walk scores [D, V], drafts [D], unary logits [D, V])`` of one block, as decoding drafts it."""
    with torch.no_grad():
        hidden = drafter.draft_block(
            int(ids[anchor]), anchor, drafter.context_cache(feats[:anchor], torch.arange(anchor))
        )
        scores, drafts = variant_of(drafter.spec).walk(drafter, hidden[None], ids[anchor : anchor + 1])
        raw = drafter.block_logits(hidden[1:])
        unary = transform_logits(raw.to(torch.promote_types(raw.dtype, torch.float32)), **drafter.spec.logit_options)
    return scores[0], drafts[0], unary


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, both exports, and what each reference implementation computes of them (one
    call per venv)."""
    model, tok = load_tiny_target()
    root = tmp_path_factory.mktemp("dflash2-export")
    ckpt = make_dflash2_checkpoint(model, tok, root)
    text = load_split("held_out", limit=2)[1].text[:3000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    target = TargetModel(model)
    feats = target.features(ids, need_teacher=False).context
    anchors = torch.tensor(ANCHORS)
    spec_dir = export_checkpoint(ckpt, root / "spec", "speculators", target_model=model)
    zlab_dir = export_checkpoint(ckpt, root / "zlab", "zlab")
    # the reference implementations run in the inputs' dtype: float64, as reference64 below
    save_file({"features": feats.double().contiguous(), "input_ids": ids, "anchors": anchors}, str(root / "in-spec.st"))
    save_file(
        {
            "features": zlab_features(model, ids, list(target.layer_ids)).double().contiguous(),
            "input_ids": ids,
            "anchors": anchors,
            "embed": model.get_input_embeddings().weight.detach().double().contiguous(),
            "head": model.get_output_embeddings().weight.detach().double().clone(),  # tied: its own copy
        },
        str(root / "in-zlab.st"),
    )
    speculators = run_external(
        speculators_python(), "speculators_dflash2_select.py", spec_dir, root / "in-spec.st", root / "out-spec.st"
    )
    zlab = run_external(zlab_python(), "zlab_dflash2_propose.py", zlab_dir, root / "in-zlab.st", root / "out-zlab.st")
    reference = bf16_rounded(load_drafter(ckpt, target)[0])  # the exported weights are bf16
    reference64 = bf16_rounded(load_drafter(ckpt, float64_target(model))[0]).double()
    return {
        "model": model,
        "target": target,
        "ckpt": ckpt,
        "ids": ids,
        "feats": feats,
        "anchors": anchors,
        "dirs": {"speculators": spec_dir, "zlab": zlab_dir},
        "speculators": speculators,
        "zlab": zlab,
        "reference": reference,
        "reference64": reference64,
    }


def test_the_exports_hold_the_dflash2_contracts(setup):
    spec_cfg = json.loads((setup["dirs"]["speculators"] / "config.json").read_text())
    assert spec_cfg["speculators_model_type"] == "dflash2" and spec_cfg["architectures"] == ["DFlash2DraftModel"]
    assert spec_cfg["speculators_config"]["algorithm"] == "dflash2"
    assert {k: spec_cfg[k] for k in SETTINGS} == SETTINGS
    assert spec_cfg["draft_vocab_size"] == spec_cfg["transformer_layer_config"]["vocab_size"]
    assert spec_cfg["sliding_window_non_causal"] is True  # no sliding layers: non-causal for vLLM too
    zlab_dir = setup["dirs"]["zlab"]
    zlab_cfg = json.loads((zlab_dir / "config.json").read_text())
    assert zlab_cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: zlab_cfg["dflash_config"][k] for k in SETTINGS} == SETTINGS
    # the shipped remote code computes DFlash only: no auto_map pointing at it, and no file
    assert "auto_map" not in zlab_cfg and not (zlab_dir / "modeling_dflash.py").exists()
    names = set(load_file(str(zlab_dir / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "layers.1.mlp_conv.kernel_projection.weight"} <= names


def test_speculators_dflash2_computes_our_unary_logits_and_selects_our_tokens(setup):
    theirs, reference = setup["speculators"], setup["reference64"]
    unary, hidden = training_layout(reference, setup["ids"], setup["feats"].double(), setup["anchors"])
    scores, drafts = variant_of(reference.spec).walk(reference, hidden, setup["ids"][setup["anchors"]])
    diff = (theirs["logits"][:, 1:] - unary[:, 1:]).abs().max().item()
    finite = scores.isfinite()
    ours_sorted = scores[finite].view(*drafts.shape, -1).sort(-1).values
    score_diff = (theirs["scores"].sort(-1).values - ours_sorted).abs().max().item()
    print(f"speculators: max |unary logit diff| {diff:.2e}, max |selector score diff| {score_diff:.2e}")
    bound = float64_parity_bound(reference.spec, unary[:, 1:])
    score_bound = float64_parity_bound(reference.spec, ours_sorted, extra_layers=1)  # the selector
    assert diff <= bound and score_diff <= score_bound, (bound, score_bound)
    assert torch.equal(theirs["tokens"], drafts)
    # the selector really decides: on some slots its choice is not the unary argmax
    assert (drafts != unary[:, 1:].argmax(-1)).sum() >= 20  # 76 of 91 here


def test_zlab_dflash2_proposes_our_tokens(setup):
    theirs, reference = setup["zlab"], setup["reference64"]
    walks = [served_walk(reference, setup["ids"], setup["feats"].double(), a) for a in ANCHORS]
    drafts, unary = torch.stack([w[1] for w in walks]), torch.stack([w[2] for w in walks])
    diff = (theirs["logits"] - unary).abs().max().item()
    print(f"z-lab: max |unary logit diff| {diff:.2e}")
    assert diff <= float64_parity_bound(reference.spec, unary)
    assert torch.equal(theirs["tokens"], drafts)
    # decoding's serving path and speculators' training layout select the same tokens
    assert torch.equal(theirs["tokens"], setup["speculators"]["tokens"])


@pytest.mark.parametrize("fmt", ["speculators", "zlab"])
def test_our_loader_and_export_check_read_both_folders(setup, fmt):
    folder = setup["dirs"][fmt]
    loaded, meta = load_any_drafter(folder, setup["target"])
    assert loaded.spec.variant == "dflash2" and meta["format"] == fmt
    assert {k: loaded.spec.variant_options[k] for k in SETTINGS} == SETTINGS
    for a in ANCHORS[:4]:
        got = served_walk(loaded, setup["ids"], setup["feats"], a)
        want = served_walk(setup["reference"], setup["ids"], setup["feats"], a)
        # the same weights (bf16 values, exact in fp32) through the same modules: the same bits
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    report = check_export(folder)
    assert report.problems == [], report.problems
    assert report.max_logit_diff is not None and report.max_logit_diff <= 1e-3


def _copy(folder, dest, edit_config=None, edit_weights=None):
    import shutil

    shutil.copytree(folder, dest)
    if edit_config:
        cfg = json.loads((dest / "config.json").read_text())
        edit_config(cfg)
        (dest / "config.json").write_text(json.dumps(cfg))
    if edit_weights:
        weights = load_file(str(dest / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(dest / "model.safetensors"))
    return dest


def test_a_zlab_save_pretrained_folder_with_embedding_codebooks_loads_the_same(setup, tmp_path):
    """z-lab's own save_pretrained stores the codebooks as nn.Embedding weights (``...codebook.weight``)."""

    def rename(w):
        for name in ("predecessor_codebook", "successor_codebook"):
            w[f"candidate_selector.{name}.weight"] = w.pop(f"candidate_selector.{name}")

    folder = _copy(setup["dirs"]["zlab"], tmp_path / "z", edit_weights=rename)
    loaded, _ = load_any_drafter(folder, setup["target"])
    got = served_walk(loaded, setup["ids"], setup["feats"], ANCHORS[1])
    assert torch.equal(got[1], served_walk(setup["reference"], setup["ids"], setup["feats"], ANCHORS[1])[1])


@pytest.mark.parametrize("fmt", ["speculators", "zlab"])
def test_export_check_catches_a_broken_dflash2_folder(setup, tmp_path, fmt):
    def fields(cfg):
        return cfg["dflash_config"] if fmt == "zlab" else cfg

    top_k = _copy(setup["dirs"][fmt], tmp_path / "k", edit_config=lambda c: fields(c).update(selector_top_k=6))
    problems = check_export(top_k).problems
    assert len(problems) == 1 and "slots with other candidates than the checkpoint's" in problems[0], problems

    def double(w):
        w["candidate_selector.successor_codebook"] = w["candidate_selector.successor_codebook"] * 2

    succ = _copy(setup["dirs"][fmt], tmp_path / "s", edit_weights=double)
    problems = check_export(succ).problems
    assert len(problems) == 1 and problems[0].startswith("block logits vs checkpoint dflash2: max |diff|"), problems
    rank = _copy(setup["dirs"][fmt], tmp_path / "r", edit_config=lambda c: fields(c).update(selector_rank=32))
    problems = check_export(rank).problems
    assert any(
        p.startswith("candidate_selector.predecessor_codebook is (8192, 16), the config gives") for p in problems
    )


@pytest.mark.parametrize(
    "fmt, edit, needle",
    [
        ("speculators", lambda c: c.update(conv_group_size=0), "conv_group_size 0"),
        ("speculators", lambda c: c.update(selector_top_k="many"), "selector_top_k 'many'"),
        ("zlab", lambda c: c["dflash_config"].pop("selector_rank"), "without dflash_config.selector_rank"),
        ("zlab", lambda c: c["dflash_config"].update(conv_kernel_size=-1), "conv_kernel_size -1"),
    ],
)
def test_a_bad_dflash2_setting_is_one_line(setup, tmp_path, fmt, edit, needle):
    folder = _copy(setup["dirs"][fmt], tmp_path / "bad", edit_config=edit)
    with pytest.raises(UserError, match=needle) as err:
        read_drafter_folder(folder)
    assert "\n" not in str(err.value)


def test_a_group_size_that_does_not_divide_the_hidden_size_is_one_line(setup, tmp_path):
    folder = _copy(setup["dirs"]["speculators"], tmp_path / "g", edit_config=lambda c: c.update(conv_group_size=24))
    with pytest.raises(UserError, match="conv_group_size 24 must divide the hidden size 256") as err:
        load_any_drafter(folder, setup["target"])
    assert "\n" not in str(err.value)


def test_a_speculators_dflash2_config_without_the_causal_flag_reads_its_default(setup, tmp_path):
    """DFlash2SpeculatorConfig defaults sliding_window_non_causal to true (DFlash's default is false)."""
    folder = _copy(
        setup["dirs"]["speculators"], tmp_path / "d", edit_config=lambda c: c.pop("sliding_window_non_causal")
    )
    assert read_drafter_folder(folder).spec.causal_in_block_sliding is False
    dflash = _copy(folder, tmp_path / "f", edit_config=lambda c: c.update(speculators_model_type="dflash"))
    assert read_drafter_folder(dflash).spec.causal_in_block_sliding is True


def test_the_check_compares_walk_scores_over_their_candidates():
    """-inf outside the candidates is no difference; other candidates and NaN are."""
    from dflash_trainer.export.formats import compare_draft_logits

    inf = float("-inf")
    want = torch.tensor([[1.0, inf, 2.0], [inf, 0.5, inf]])
    # 1 + 1e-4 in fp32 is 1 + 1e-4 within half an ulp of 1 (2^-24): the difference read back is that
    assert compare_draft_logits(want + torch.tensor([[1e-4, 0.0, 0.0], [0.0, 0.0, 0.0]]), want) == (
        pytest.approx(1e-4, rel=0, abs=2.0**-24),
        0,
    )
    moved = torch.tensor([[1.0, 3.0, inf], [inf, 0.5, inf]])  # slot 0 scores another candidate
    assert compare_draft_logits(moved, want) == (0.0, 1)
    assert compare_draft_logits(torch.full_like(want, float("nan")), want)[0] == float("inf")
