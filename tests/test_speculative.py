"""Speculative decoding (chain and DDTree) is lossless, and its tau matches teacher forcing."""

import json
import subprocess
import sys

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.data.blocks import build_blocks
from dflash_trainer.inference.speculative import SpeculativeDecoder, target_greedy
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.checkpoint import save_drafter
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.trainer import Trainer

EOS = [0, 2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A drafter trained briefly on the tiny target's own greedy continuations (so drafts get accepted)."""
    root = tmp_path_factory.mktemp("spec")
    cfg0 = load_config(["tiny-demo"])
    from dflash_trainer.model.loading import load_target

    model, tok, _ = load_target(cfg0.target)
    records, prompts = [], []
    for f in load_split("held_out", limit=40):
        lines = f.text.splitlines(keepends=True)
        user = f"Continue the Python module `{f.relpath}`:\n{''.join(lines[:8])}"
        ids = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out, _ = target_greedy(model, ids, 64, EOS)
        records.append(
            {
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)},
                ]
            }
        )
        prompts.append(ids)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[8:]))
    cfg = load_config(
        ["tiny-demo"],
        [
            f"data.train_files=[{data}]",
            f"output_dir={root / 'run'}",
            "train.max_steps=150",
            "train.eval_every=150",
            "train.save_every=150",
            "data.max_eval_rows=1",
            "train.lr=3e-3",
        ],
    )
    target, tok, rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=root / "run", target_path="tiny", progress=False)
    trainer.fit()
    ckpt = save_drafter(trainer.drafter, root / "ckpt", target=target, target_path="tiny")
    return {
        "target": target,
        "drafter": trainer.drafter.eval(),
        "prompts": prompts[:8],
        "tok": tok,
        "ckpt": ckpt,
        "records": records[:8],
        "root": root,
    }


@pytest.mark.parametrize("mode, budget", [("chain", 1), ("ddtree", 1), ("ddtree", 8), ("ddtree", 64)])
def test_output_is_identical_to_target_greedy(trained, mode, budget):
    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    accepted_any = 0
    for ids in trained["prompts"]:
        ref, _ = target_greedy(trained["target"].model, ids, 48, EOS)
        res = decoder.generate(ids, 48, mode, budget=budget)
        assert res.tokens == ref
        accepted_any += sum(res.accepted)
    assert accepted_any > 0  # drafts were really accepted, so cache cropping/compaction was exercised


def test_chain_tau_equals_teacher_forcing_at_the_visited_anchors(trained):
    """Generate's per-round acceptance equals the batched training layout's teacher-forced acceptance
    at the same anchors (they measure the same thing for greedy decoding)."""
    target, drafter = trained["target"], trained["drafter"]
    decoder = SpeculativeDecoder(target, drafter, EOS)
    b = drafter.spec.block_size
    for ids in trained["prompts"][:4]:
        res = decoder.generate(ids, 48, "chain")
        row = torch.tensor(ids + res.tokens)
        positions = torch.arange(row.numel())
        feats = target.features(row, positions, need_teacher=True)
        anchors = torch.tensor([a for a in res.anchors if a + b <= row.numel()])
        blocks = build_blocks(
            row,
            positions,
            torch.ones_like(row),
            anchors,
            block_size=b,
            mask_token_id=drafter.spec.mask_token_id,
            gamma=4.0,
        )
        doc = torch.zeros_like(row)
        with torch.no_grad():
            hidden = drafter(
                blocks.input_ids,
                blocks.position_ids,
                feats.context,
                positions,
                drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense"),
            )
        draft = drafter.block_logits(hidden.view(len(anchors), b, -1)[:, 1:]).argmax(-1)
        greedy = (feats.last_hidden[blocks.teacher_index[:, 1:]] @ target.lm_head_weight.T).argmax(-1)
        teacher_forced = (draft == greedy).long().cumprod(1).sum(1).tolist()
        assert teacher_forced == res.accepted[: len(anchors)]


def test_cli_reports_tau_speedup_and_agreement(trained, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in trained["records"][:3]))
    out = tmp_path / "spec.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_trainer.cli",
            "speculate",
            "--mode",
            "ddtree",
            "--budget",
            "4",
            "--budget",
            "32",
            "--drafter",
            str(trained["ckpt"]),
            "--input",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "spec.jsonl.report.json").read_text())
    assert set(report["modes"]) == {"ddtree-4", "ddtree-32"}
    for mode in report["modes"].values():
        assert mode["mismatches"] == 0 and 1.0 <= mode["tau"] <= 8 and mode["speedup"] > 0
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_trainer.cli",
            "speculate",
            "--mode",
            "ddtree",
            "--budget",
            "0",
            "--drafter",
            str(trained["ckpt"]),
            "--input",
            str(prompts),
            "--output",
            str(tmp_path / "x.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "dflash-train: error: --budget must be >= 1, got 0"
    ]


def test_bad_arguments(trained):
    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([], 8)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        decoder.generate([1, 2, 3], 8, "ddtree", budget=0)


def test_generate_chain_tau_agrees_with_eval_decode_tau(trained):
    """On the same prompts, `speculate --mode chain` and `eval` (its decode-path tau, walked
    over the target's greedy responses) measure the same tau."""
    from dflash_trainer.data.documents import Document
    from dflash_trainer.data.packing import pack_documents
    from dflash_trainer.inference.acceptance import decode_path_acceptance

    target, drafter = trained["target"], trained["drafter"]
    decoder = SpeculativeDecoder(target, drafter, EOS)
    docs, rounds, total = [], 0, 0
    for i, ids in enumerate(trained["prompts"]):
        ref, _ = target_greedy(target.model, ids, 48, EOS)
        res = decoder.generate(ids, 48, "chain")
        # the last round may run past the response; eval cannot place a block there, so compare the rest
        full = [(a, n) for a, n in zip(res.anchors, res.accepted) if a + drafter.spec.block_size <= len(ids) + len(ref)]
        rounds += len(full)
        total += sum(n + 1 for _, n in full)
        docs.append(Document(ids + ref, [0] * len(ids) + [1] * len(ref), "mem", i))
    rows = pack_documents(docs, 512, 0)
    report = decode_path_acceptance(target, drafter, rows)
    assert report["rounds"] == rounds
    assert abs(report["tau"] - total / rounds) < 1e-9
