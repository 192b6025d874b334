"""Serving parity with the external reference code, not a copy of it.

- ``speculators`` (PyPI, pins transformers <= 5.19): installed by ``speculators_python`` into its own
  virtual environment under ``.venv/speculators`` (once; later runs reuse it), which then loads our
  exports with the package's own ``DFlashDraftModel.from_pretrained`` (tests/external/
  speculators_block_logits.py) and computes their block logits with its own masks.
- z-lab's model code (github z-lab/dflash, ``dflash/model.py``) is not on PyPI. What it does with the
  last layer and with sliding windows was read from it and is pinned here: its feature extraction takes
  transformers' ``hidden_states[l + 1]``; its attention either applies no mask at all (the transformers
  4.57 version: ``sliding_window`` is only a keyword its sdpa/eager paths ignore) or, in later
  versions, a window of W keys counted over [context ; block] and causal over both, with
  ``causal_in_block_sliding`` read by neither.
"""

import json
import re
import sys
from dataclasses import replace

import pytest
import torch
from external_runner import run_script
from external_venvs import speculators_python
from safetensors.torch import load_file, save_file
from test_export import ANCHORS, bf16_rounded, block_logits, float64_parity_bound, float64_target, make_checkpoint
from transformers import AutoModel

from dflash_trainer.drafter_folder import load_drafter
from dflash_trainer.export.formats import export_checkpoint, zlab_features
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target
from dflash_trainer.tiny_target.corpus import load_split

SCRIPT = "speculators_block_logits.py"  # in tests/external

WINDOW = {"sliding_window_layers": [0, 2], "sliding_window": 16}
VARIANTS = {
    "defaults": ({}, None),
    "windows": ({**WINDOW, "causal_in_block_sliding": False}, None),
    "windows-causal-in-block": ({**WINDOW, "causal_in_block_sliding": True}, None),
    "last-layer": ({}, [1, 3, 5, 7]),  # 7 = the 8-layer tiny target's last layer
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok = load_tiny_target()
    text = load_split("held_out", limit=2)[1].text[:3000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    root = tmp_path_factory.mktemp("parity")
    ckpts = {name: make_checkpoint(model, tok, root, name, kw, layer_ids) for name, (kw, layer_ids) in VARIANTS.items()}
    return {
        "model": model,
        "model64": float64_target(model).model,
        "tok": tok,
        "ids": ids,
        "root": root,
        "ckpts": ckpts,
    }


def trained(tiny, name, dtype=torch.float32):
    """``(bf16-rounded drafter in ``dtype``, the setup dict block_logits wants)`` for a variant, with the
    features training used (pre-norm hooks at the checkpoint's layer ids, computed in fp32, given in
    ``dtype``); in float64 the target's embedding and head it shares are float64 too."""
    layer_ids = VARIANTS[name][1]
    target = TargetModel(tiny["model"], layer_ids=layer_ids)
    feats = target.features(tiny["ids"], need_teacher=False).context.to(dtype)
    if dtype == torch.float64:
        target = TargetModel(tiny["model64"], layer_ids=layer_ids)
    drafter = bf16_rounded(load_drafter(tiny["ckpts"][name], target)[0]).to(dtype)
    return drafter, {"ids": tiny["ids"], "feats": feats}


def report(label, got, want):
    diff = (got - want).abs().max().item()
    agree = int((got[:, 1:].argmax(-1) == want[:, 1:].argmax(-1)).sum())
    print(f"{label}: max |logit diff| {diff:.2e}, top-1 agreement {agree}/{want[:, 1:, 0].numel()} draft slots")
    return diff


# ---------------------------------------------------------------------------------------------------
# speculators: the package's own DFlashDraftModel loads each export and computes the block logits
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speculators_logits(tiny):
    python = speculators_python()
    root, jobs, outputs = tiny["root"], [], {}
    for name in VARIANTS:
        out = export_checkpoint(tiny["ckpts"][name], root / f"spec-{name}", "speculators", target_model=tiny["model"])
        _, s = trained(tiny, name, torch.float64)  # speculators runs in the inputs' dtype
        save_file(
            {"features": s["feats"].contiguous(), "input_ids": tiny["ids"], "anchors": torch.tensor(ANCHORS)},
            str(root / f"in-{name}.safetensors"),
        )
        jobs.append(
            {
                "export": str(out),
                "inputs": str(root / f"in-{name}.safetensors"),
                "output": str(root / f"out-{name}.safetensors"),
            }
        )
        outputs[name] = root / f"out-{name}.safetensors"
    # What the export used to record as the verifier: target.path ("tiny"), no folder and no hub name.
    legacy = export_checkpoint(
        tiny["ckpts"]["defaults"], root / "spec-legacy", "speculators", target_model=tiny["model"]
    )
    cfg = json.loads((legacy / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "tiny"
    (legacy / "config.json").write_text(json.dumps(cfg))
    jobs.append({"export": str(legacy), "inputs": jobs[0]["inputs"], "output": str(root / "out-legacy.safetensors")})
    outputs["legacy"] = root / "out-legacy.safetensors"
    (root / "jobs.json").write_text(json.dumps(jobs))
    run_script(python, SCRIPT, root / "jobs.json", cwd=root)
    results = {}
    for name, path in outputs.items():
        data = load_file(str(path))
        results[name] = bytes(data["error"].tolist()).decode() if "error" in data else data["logits"]
    return results


@pytest.mark.parametrize("name", list(VARIANTS))
def test_speculators_computes_our_block_logits(tiny, speculators_logits, name):
    got = speculators_logits[name]
    assert isinstance(got, torch.Tensor), got
    drafter, s = trained(tiny, name, torch.float64)
    want = block_logits(drafter, s)
    assert report(f"speculators {name}", got, want) <= float64_parity_bound(drafter.spec, want)


@pytest.mark.parametrize("name", ["windows", "windows-causal-in-block"])
def test_speculators_applies_the_trained_window_and_causal_rule(tiny, speculators_logits, name):
    """The parity above is not vacuous: without the window, or with the other causal-in-block setting,
    our logits move far from what speculators computed."""
    drafter, s = trained(tiny, name, torch.float64)
    for changed in (
        replace(drafter.spec, sliding_window_layers=()),
        replace(drafter.spec, causal_in_block_sliding=not drafter.spec.causal_in_block_sliding),
    ):
        other = DFlashDrafter(changed, drafter.target_embed[0], drafter.lm_head_weight)
        other.load_state_dict(drafter.state_dict())
        assert (block_logits(other.eval(), s) - speculators_logits[name]).abs().max() > 0.05


def test_speculators_cannot_load_the_verifier_name_tiny(speculators_logits):
    """Why the export records an absolute folder (or --verifier): speculators' from_pretrained loads the
    verifier's embedding from what is recorded, and "tiny" is no folder and no hub repository."""
    error = speculators_logits["legacy"]
    assert isinstance(error, str) and re.search(r"hub|repository|huggingface", error, re.IGNORECASE), error


# ---------------------------------------------------------------------------------------------------
# z-lab's model code, pinned from reading dflash/model.py
# ---------------------------------------------------------------------------------------------------


def test_speculators_serves_gemma_drafters_on_the_raw_embedding_table(tmp_path):
    """Why a target that scales its embeddings (Gemma: sqrt(hidden)) is a speculators mismatch: the
    package's from_pretrained reloads embed_tokens from the verifier's raw table, so the scaled rows the
    export writes (and the drafter trained on) are not what it drafts from. Export refuses; with
    --allow-mismatch the export records it."""
    from families import build_family
    from transformers import AutoTokenizer

    from dflash_trainer.errors import UserError
    from dflash_trainer.model.target import embedding_scale

    python = speculators_python()
    folder = tmp_path / "gemma3"
    model = build_family("gemma3", folder)
    scale = embedding_scale(model)
    assert scale > 2  # sqrt(hidden)
    ckpt = make_checkpoint(model, AutoTokenizer.from_pretrained(folder), tmp_path, "ckpt", {}, [1, 2])
    kwargs = {"target_model": model, "verifier": str(folder)}
    with pytest.raises(UserError, match="reloads embed_tokens from the verifier's raw table"):
        export_checkpoint(ckpt, tmp_path / "refused", "speculators", **kwargs)
    out = export_checkpoint(ckpt, tmp_path / "spec", "speculators", allow_mismatch=True, **kwargs)
    assert any("raw table" in m for m in json.loads((out / "config.json").read_text())["dflash_trainer_mismatches"])
    written = load_file(str(out / "model.safetensors"))["embed_tokens.weight"].float()
    raw = model.get_input_embeddings().weight.detach().float()
    assert torch.allclose(written, (raw * scale).bfloat16().float())  # the export holds the trained rows

    (tmp_path / "jobs.json").write_text(json.dumps([{"export": str(out), "output": str(tmp_path / "embed.st")}]))
    run_script(python, SCRIPT, tmp_path / "jobs.json", cwd=tmp_path, timeout=600)
    data = load_file(str(tmp_path / "embed.st"))
    assert "embed" in data, bytes(data["error"].tolist()).decode()
    served = data["embed"]
    print(
        f"speculators' embed_tokens vs raw: {(served - raw).abs().max():.2e}; vs trained (x{scale:.3g}) rows: "
        f"{(served - written).abs().max():.2e}"
    )
    assert torch.equal(served.float(), raw.bfloat16().float())  # the verifier's table, as saved (in bf16)
    assert not torch.allclose(served, written, rtol=0.1, atol=1e-2)


def test_zlab_feature_read_is_post_norm_for_the_last_layer(tiny):
    """z-lab id l = transformers' hidden_states[l + 1]: the hooked (pre-norm) output for l < n - 1, but
    the final-normed hidden state for l = n - 1, which training never saw."""
    model, ids = tiny["model"], tiny["ids"]
    n = model.config.num_hidden_layers
    hooked = TargetModel(model, layer_ids=list(range(n))).features(ids, need_teacher=False).context
    hooked = hooked.view(ids.numel(), n, -1)
    read = zlab_features(model, ids, list(range(n))).view(ids.numel(), n, -1)
    # the same forward of the same model and ids (and the same final norm): equal bit for bit
    assert torch.equal(read[:, : n - 1], hooked[:, : n - 1])
    assert torch.equal(read[:, n - 1], model.model.norm(hooked[:, n - 1]))
    assert (read[:, n - 1] - hooked[:, n - 1]).abs().max() > 1.0


def zlab_visibility(n_ctx, block, window, reading):
    """``[B, n_ctx + B]`` keys a block slot sees on a sliding-window layer in z-lab's code (None = all):
    "4.57": no mask (sdpa/eager ignore the sliding_window keyword); "current": slot j sits at key
    index n_ctx + j and sees keys k with k <= n_ctx + j and n_ctx + j - k < W."""
    if reading == "4.57":
        return None
    q = n_ctx + torch.arange(block)[:, None]
    k = torch.arange(n_ctx + block)[None, :]
    return (k <= q) & (q - k < window)


def hf_block_logits(hf, tiny, feats, head, sliding_mask):
    """Block logits of the exported model (loaded with transformers), with ``sliding_mask(n_ctx)`` as the
    sliding-window layers' visibility and no mask on full-attention layers, as z-lab's code has it."""
    module = sys.modules[type(hf).__module__]
    ids, mask_id, b = tiny["ids"], tiny["tok"].mask_token_id, hf.config.block_size
    out = []
    for a in ANCHORS:
        x = tiny["model64"].get_input_embeddings()(torch.tensor([int(ids[a])] + [mask_id] * (b - 1)))
        context = hf.hidden_norm(hf.fc(feats[:a]))
        cos, sin = module._rope(torch.arange(a + b), hf.layers[0].self_attn.head_dim, hf._rope_theta(), x.dtype)
        with torch.no_grad():
            for layer, kind in zip(hf.layers, hf.config.layer_types):
                x = layer(x, context, cos, sin, sliding_mask(a) if kind == "sliding_attention" else None)
            out.append(hf.norm(x) @ head.T)
    return torch.stack(out)


@pytest.mark.parametrize("name", ["defaults", "windows", "windows-causal-in-block"])
def test_zlab_attention_reproduces_defaults_but_not_trained_windows(tiny, name, tmp_path):
    # float64 throughout (the exported code's norm keeps float64): the two differ by rounding alone
    drafter, s = trained(tiny, name, torch.float64)
    want = block_logits(drafter, s)
    out = export_checkpoint(tiny["ckpts"][name], tmp_path / "z", "zlab", allow_mismatch=True)
    hf = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float64, local_files_only=True).eval()
    head, spec = tiny["model64"].get_output_embeddings().weight, drafter.spec
    bound = float64_parity_bound(spec, want)
    b = spec.block_size

    def as_trained(n_ctx):
        return hf._sliding_mask(None, n_ctx, b, spec.causal_in_block_sliding, "cpu")

    # The harness computes the trained logits when given the trained rule...
    assert (
        report(f"zlab-layout {name} trained rule", hf_block_logits(hf, tiny, s["feats"], head, as_trained), want)
        <= bound
    )
    for reading in ("4.57", "current"):
        got = hf_block_logits(
            hf, tiny, s["feats"], head, lambda n_ctx: zlab_visibility(n_ctx, b, spec.sliding_window, reading)
        )
        diff = report(f"z-lab {reading} reading, {name}", got, want)
        if name == "defaults":
            assert diff <= bound  # no sliding layers: z-lab's code computes what was trained
        else:
            assert diff > 0.05  # the export refuses these without --allow-mismatch
