"""Drafters this project did not write: folders written by speculators' own ``save_pretrained``, by
z-lab's own ``DFlashDraftModel`` (PyPI ``dflash``, also in the transformers-4 dialect of z-lab's
published checkpoints) and by SpecForge's ``DFlashDraftModel`` (PyPI ``specforge``), each in its
separate venv (``external_venvs``), load through ``load_export``
and compute the block logits the writer's own model code computes (both in float64, within rounding:
``test_export.float64_parity_bound``); ``eval``, ``speculate`` and
``export --check`` take them; what this project's drafter cannot represent is one line."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from cli_runs import in_process
from external_runner import run_script
from external_venvs import specforge_python, speculators_python, zlab_python
from safetensors.torch import load_file, save_file
from test_export import ANCHORS, block_logits, float64_parity_bound, float64_target

from dflash_trainer.errors import UserError
from dflash_trainer.export.formats import check_export, load_export
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target import load_tiny_target, tiny_target_path
from dflash_trainer.tiny_target.corpus import load_split

ZLAB_IDS = [1, 3, 5]  # z-lab ids of the tiny target's layers the drafters read; speculators' aux ids are +1
LAYER = {  # a small Qwen3 drafter of the tiny target's width (hidden 256, vocabulary 8,192)
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8192,
    "initializer_range": 0.05,
}
WINDOWS = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "use_sliding_window": True}
SPECULATORS = {  # written by speculators' save_pretrained; RoPE theta is Qwen3Config's default, 10,000
    "spec-defaults": ({}, {}),
    "spec-windows": (WINDOWS, {}),
    "spec-windows-non-causal": (WINDOWS, {"sliding_window_non_causal": True}),
}
ZLAB_CLASS = "dflash.model:DFlashDraftModel"  # z-lab's own
SPECFORGE_CLASS = "specforge.modeling.draft.dflash:DFlashDraftModel"  # SpecForge's, the same layout
ZLAB = ["zlab-saved", "zlab-published", "zlab-top-level", "specforge-saved"]


def run_external(python, script, jobs, root):
    (root / f"{script}.jobs.json").write_text(json.dumps(jobs))
    run_script(python, script, root / f"{script}.jobs.json", cwd=root)


def result(path):
    data = load_file(str(path))
    return bytes(data["error"].tolist()).decode() if "error" in data else data["logits"]


def published_dialect(folder):
    """Rewrite a z-lab save_pretrained config the way z-lab's published checkpoints hold it (written by
    transformers 4.57): top-level rope_theta, rope_scaling null, no rope_parameters."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], rope_scaling=None, transformers_version="4.57.1")
    cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """Every folder written by its writer's code, and the block logits the writer's code computes."""
    model, tok = load_tiny_target()
    root = tmp_path_factory.mktemp("foreign")
    text = load_split("held_out", limit=2)[1].text[:3000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    # the writers' code runs in the inputs' dtype: float64, as ours does in ``ours``
    feats = TargetModel(model, layer_ids=ZLAB_IDS).features(ids, need_teacher=False).context.double()
    inputs = root / "inputs.safetensors"
    save_file(
        {
            "features": feats.contiguous(),
            "input_ids": ids,
            "anchors": torch.tensor(ANCHORS),
            "embed": model.get_input_embeddings().weight.detach().double().contiguous(),
            "head": model.get_output_embeddings().weight.detach().double().clone(),  # tied: its own copy
        },
        str(inputs),
    )
    verifier = str(tiny_target_path())
    run_external(
        speculators_python(),
        "speculators_save.py",
        [
            {
                "out": str(root / name),
                "verifier": verifier,
                "seed": i,
                "layer": {**LAYER, **layer},
                "dflash": {"aux_hidden_state_layer_ids": [i + 1 for i in ZLAB_IDS], "mask_token_id": 3, **dflash},
            }
            for i, (name, (layer, dflash)) in enumerate(SPECULATORS.items())
        ],
        root,
    )
    run_external(
        speculators_python(),
        "speculators_block_logits.py",
        [{"export": str(root / n), "inputs": str(inputs), "output": str(root / f"{n}.out")} for n in SPECULATORS],
        root,
    )
    zlab = {**LAYER, "block_size": 8, "num_target_layers": 8}
    dflash = {"mask_token_id": 3, "target_layer_ids": ZLAB_IDS}
    jobs = {
        "zlab-saved": {"config": {**zlab, "dflash_config": dflash}},
        "zlab-published": {"config": {**zlab, "rope_theta": 1e6, "dflash_config": dflash}},
        # z-lab's code reads each of its fields from dflash_config first, then from the top level
        "zlab-top-level": {"config": {**zlab, "block_size": 6, "mask_token_id": 3, "target_layer_ids": ZLAB_IDS}},
        "specforge-saved": {"config": {**zlab, "dflash_config": dflash}},
    }
    for i, (name, job) in enumerate(jobs.items()):
        job.update(
            out=str(root / name), seed=10 + i, **{"class": SPECFORGE_CLASS if "specforge" in name else ZLAB_CLASS}
        )
    zlab_jobs = [job for name, job in jobs.items() if "specforge" not in name]
    spec_jobs = [job for name, job in jobs.items() if "specforge" in name]
    run_external(zlab_python(), "zlab_layout_drafter.py", zlab_jobs, root)
    run_external(specforge_python(), "zlab_layout_drafter.py", spec_jobs, root)
    published_dialect(root / "zlab-published")
    for job in jobs.values():
        job.pop("config")
        job.update(inputs=str(inputs), output=f"{job['out']}.out")
    run_external(zlab_python(), "zlab_layout_drafter.py", zlab_jobs, root)
    run_external(specforge_python(), "zlab_layout_drafter.py", spec_jobs, root)
    target64 = float64_target(model, ZLAB_IDS)
    return {"model": model, "tok": tok, "root": root, "target64": target64, "s": {"ids": ids, "feats": feats}}


def ours(foreign, name):
    """``(our float64 block logits of the folder name, the bound its parity check allows)``."""
    drafter = load_export(foreign["root"] / name, foreign["target64"], torch.float64)
    logits = block_logits(drafter, foreign["s"])
    return logits, float64_parity_bound(drafter.spec, logits)


def report(label, got, want):
    diff = (got - want).abs().max().item()
    agree = int((got.argmax(-1) == want.argmax(-1)).sum())
    print(f"{label}: max |logit diff| {diff:.2e}, top-1 agreement {agree}/{want[..., 0].numel()} slots")
    return diff


@pytest.mark.parametrize("name", list(SPECULATORS))
def test_speculators_save_pretrained_folder_computes_speculators_logits(foreign, name):
    want = result(foreign["root"] / f"{name}.out")
    assert isinstance(want, torch.Tensor), want
    got, bound = ours(foreign, name)
    assert report(name, got, want) <= bound


@pytest.mark.parametrize("name", ZLAB)
def test_zlab_folder_computes_zlab_logits(foreign, name):
    want = result(foreign["root"] / f"{name}.out")
    assert isinstance(want, torch.Tensor), want
    got, bound = ours(foreign, name)
    got = got[:, 1:]  # z-lab's code returns the draft slots 1..B-1
    assert got.shape == want.shape
    assert report(name, got, want) <= bound


def test_the_windows_and_rope_read_matter(foreign):
    """The parities above are not vacuous: the windowed folders differ from the plain rule, and the
    theta 1e6 that a top-level-only read of rope_theta used to assume moves the logits far."""
    root = foreign["root"]
    spec = result(root / "spec-windows.out")
    non_causal = result(root / "spec-windows-non-causal.out")
    assert (spec - non_causal).abs().max() > 0.05  # different weights too, but the rule is read per folder
    cfg_file = root / "spec-defaults" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    moved = root / "spec-theta-1e6"
    shutil.copytree(root / "spec-defaults", moved)
    cfg["transformer_layer_config"]["rope_parameters"]["rope_theta"] = 1e6
    (moved / "config.json").write_text(json.dumps(cfg))
    assert report("theta 1e6", ours(foreign, "spec-theta-1e6")[0], result(root / "spec-defaults.out")) > 0.05


def edited(foreign, name, tmp_path, edit, weights=None):
    folder = tmp_path / f"{name}-edited"
    shutil.copytree(foreign["root"] / name, folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    if weights:
        state = load_file(str(folder / "model.safetensors"))
        save_file({**state, **weights}, str(folder / "model.safetensors"))
    return folder


def _layer(key, value):
    return lambda c: c["transformer_layer_config"].update({key: value})


REFUSALS = [
    (
        "spec-defaults",
        _layer("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}),
        "RoPE type 'dynamic'",
    ),
    (  # YaRN as DeepSeek writes it: mscale changes the attention factor in a way the drafter does not compute
        "spec-defaults",
        _layer(
            "rope_parameters",
            {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
        r"yarn RoPE with \['mscale', 'mscale_all_dim'\]",
    ),
    ("spec-defaults", _layer("attention_bias", True), "attention_bias is true"),
    ("spec-defaults", _layer("hidden_act", "gelu"), "hidden_act 'gelu'"),
    ("spec-defaults", lambda c: c.update(sample_from_anchor=True), "sample_from_anchor is true"),
    ("spec-defaults", lambda c: c.update(draft_vocab_size=4096), "reduced draft vocabulary"),
    ("spec-defaults", lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type 'eagle3'"),
    ("spec-defaults", lambda c: c.update(aux_hidden_state_layer_ids=[0, 2, 4]), "include 0"),
    ("spec-defaults", lambda c: c.update(mask_token_id=None), "no mask_token_id"),
    (
        "zlab-saved",
        lambda c: c.update(
            layer_types=["sliding_attention", "full_attention"], sliding_window=16, use_sliding_window=True
        ),
        "sliding-window",
    ),
    ("zlab-saved", lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2"),
    ("zlab-saved", lambda c: c["dflash_config"].update(input_embedding_scale=2.0), "input_embedding_scale 2"),
    ("zlab-saved", lambda c: c["dflash_config"].update(target_layer_ids=[1, 3, 7]), "last layer"),
    ("specforge-saved", lambda c: c["dflash_config"].update(shift_label=True), "shift_label True"),
    ("specforge-saved", lambda c: c["dflash_config"].update(projector_type="mlp"), "projector_type 'mlp'"),
]


@pytest.mark.parametrize("name, edit, needle", REFUSALS)
def test_what_the_drafter_cannot_represent_is_one_line(foreign, tmp_path, name, edit, needle):
    folder = edited(foreign, name, tmp_path, edit)
    target = TargetModel(foreign["model"], layer_ids=[1, 3, 7] if "last layer" in needle else ZLAB_IDS)
    with pytest.raises(UserError, match=needle) as err:
        load_export(folder, target)
    assert "\n" not in str(err.value)


def test_tensors_without_a_place_are_refused(foreign, tmp_path):
    folder = edited(foreign, "zlab-saved", tmp_path, lambda c: None, {"candidate_selector.w": torch.zeros(2)})
    with pytest.raises(UserError, match=r"no place for \(candidate_selector.w\)"):
        load_export(folder, TargetModel(foreign["model"], layer_ids=ZLAB_IDS))


def test_check_of_a_foreign_folder_names_weights_that_do_not_fit(foreign, tmp_path):
    folder = edited(foreign, "spec-defaults", tmp_path, lambda c: None, {"fc.weight": torch.zeros(256, 512)})
    problems = check_export(folder).problems
    assert len(problems) == 1 and "its weights do not fit its config" in problems[0] and "fc.weight" in problems[0]


def cli(*args, cwd, process=True):
    """``(exit status, stdout, stderr)`` of ``dflash-train ARGS`` run in ``cwd``: a process, or with
    ``process`` false ``cli.main`` in this one (tests/cli_runs.py: no interpreter start and import of
    torch and transformers, 5 CPU-s a run) where the process boundary is checked elsewhere: ``eval`` as a
    process in test_a_refusal_in_eval_is_one_error_line, ``speculate`` in test_speculative.py."""
    if not process:
        here = os.getcwd()
        os.chdir(cwd)
        try:
            done = in_process(*args)
        finally:
            os.chdir(here)
        return done.returncode, done.stdout, done.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_trainer.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_eval_speculate_and_check_take_foreign_folders(foreign, tmp_path):
    root = foreign["root"]
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Continue `{f.relpath}`"},
                        {"role": "assistant", "content": f.text[:400]},
                    ]
                }
            )
            + "\n"
            for f in load_split("held_out", limit=3)
        )
    )
    code, out, err = cli(
        "eval", str(root / "spec-windows"), str(root / "zlab-published"), "--data", str(data), "--out", str(tmp_path / "r"),
        "--budgets", "4", "--max-blocks-per-row", "4", "--set", f"target.path={tiny_target_path()}", cwd=tmp_path,
        process=False,
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [e["label"] for e in report["checkpoints"]] == ["spec-windows", "zlab-published"]
    assert all(e["report"]["blocks"] > 0 and e["layer_ids"] == ZLAB_IDS for e in report["checkpoints"])
    # the speculators folder names its verifier (the tiny target's folder): no --set needed
    code, out, err = cli(
        "speculate", "--drafter", str(root / "spec-defaults"), "--input", str(data), "--output", str(tmp_path / "o.jsonl"),
        "--max-new-tokens", "8", "--limit", "2", cwd=tmp_path, process=False,
    )  # fmt: skip
    assert code == 0, err  # 0: speculative output equal to target-only greedy decoding
    assert "outputs differing from target greedy: 0" in out
    rep = check_export(root / "spec-defaults")
    assert rep.problems == [], rep.problems
    assert any("not written by dflash-trainer" in n for n in rep.notes), rep.notes
    rep = check_export(root / "zlab-published", str(tiny_target_path()))
    assert rep.problems == [], rep.problems


def test_a_refusal_in_eval_is_one_error_line(foreign, tmp_path):
    folder = edited(foreign, "spec-defaults", tmp_path, lambda c: c.update(sample_from_anchor=True))
    code, _, err = cli("eval", str(folder), "--data", str(tmp_path), "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "sample_from_anchor is true" in err, err


def test_a_drafter_trained_by_speculators_scores_the_same_tau_in_our_eval(tmp_path):
    """speculators' own code trains a drafter (its layer config, from_training_args, forward and KL loss)
    on the tiny target's greedy continuations (the demo's kind of data) and counts greedy acceptance
    with its own model code at every valid anchor; this project's ``eval`` of the saved folder, scoring
    every valid anchor too, gives the same tau."""
    from test_eval import write_regenerated

    from dflash_trainer.config import TargetConfig, load_config
    from dflash_trainer.data.blocks import valid_anchor_positions
    from dflash_trainer.data.packing import doc_ids_from_positions
    from dflash_trainer.data.prepare import ensure_prepared, request_for
    from dflash_trainer.model.loading import load_target

    block, seq_len = 4, 512
    model, tok, _ = load_target(TargetConfig(path="tiny", dtype="float32"))
    data = write_regenerated(tmp_path / "data.jsonl", model, tok)
    cfg = load_config([], [f"data.seq_len={seq_len}", f"data.cache_dir={tmp_path / 'cache'}"])
    # the rows eval builds from the same file (commands/eval.py), from the same prepared storage
    request = request_for(
        cfg.data, tok, model.config.vocab_size, min_tokens=block, train_paths=[str(data)], holdout="none"
    )
    rows = list(ensure_prepared(request, tok, root=cfg.data.cache_dir, progress=False).rows("train"))
    target = TargetModel(model, layer_ids=[*ZLAB_IDS, model.config.num_hidden_layers - 1])
    hidden = model.config.hidden_size
    tensors = {
        k: [] for k in ("features", "last_hidden", "input_ids", "loss_mask", "document_ids", "position_ids", "anchors")
    }
    for row in rows:
        ctx = target.features(row.input_ids, row.position_ids, need_teacher=False).context  # [L, 4H], pre-norm
        doc = doc_ids_from_positions(row.position_ids)
        anchors = valid_anchor_positions(row.loss_mask, doc, block)
        # speculators never anchors in a row's last B positions: here those are padding
        assert anchors.numel() == 0 or int(anchors.max()) < seq_len - block
        marks = torch.zeros(seq_len, dtype=torch.long)
        marks[anchors] = 1
        for key, value in (
            ("features", ctx[:, : 3 * hidden]),
            ("last_hidden", ctx[:, 3 * hidden :]),  # speculators applies the verifier's final norm itself
            ("input_ids", row.input_ids),
            ("loss_mask", row.loss_mask),
            ("document_ids", doc),
            ("position_ids", row.position_ids),
            ("anchors", marks),
        ):
            tensors[key].append(value)
    save_file({k: torch.stack(v).contiguous() for k, v in tensors.items()}, str(tmp_path / "rows.safetensors"))
    job = {
        "verifier": str(tiny_target_path()),
        "rows": str(tmp_path / "rows.safetensors"),
        "out": str(tmp_path / "spec-trained"),
        "result": str(tmp_path / "spec-tau.safetensors"),
        "steps": 150,
        "lr": 3e-3,
        "block_size": block,
        "aux_ids": [i + 1 for i in ZLAB_IDS],
        "mask_token_id": tok.mask_token_id,
        "max_anchors": 32,
        "seed": 0,
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    run_script(speculators_python(), "speculators_train.py", tmp_path / "job.json", cwd=tmp_path)
    theirs = load_file(job["result"])
    code, out, err = cli(
        "eval", job["out"], "--data", str(data), "--out", str(tmp_path / "r"), "--budgets", "2",
        "--max-blocks-per-row", "100000", "--set", f"data.seq_len={seq_len}",
        "--set", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, process=False,
    )  # fmt: skip
    assert code == 0, err
    mine = json.loads((tmp_path / "r" / "report.json").read_text())["checkpoints"][0]["report"]
    spec_tau = float(theirs["tau"])
    print(f"speculators-trained drafter: tau {spec_tau:.4f} in speculators' code, {mine['tau']:.4f} in eval, "
          f"{mine['blocks']} blocks")  # fmt: skip
    assert mine["blocks"] == theirs["accepted"].numel()
    assert spec_tau > 1.5  # it learned: the comparison is not one of two all-rejecting drafters
    assert abs(mine["tau"] - spec_tau) <= 1.0 / mine["blocks"] + 1e-9  # at most one slot's near-tie apart
