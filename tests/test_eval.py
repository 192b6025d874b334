"""`dflash-train eval`: teacher-forced chain and DDTree acceptance, checked against training's own
eval, against one-block-at-a-time decoding with a brute-force tree, and through the real command."""

import itertools
import json
from types import SimpleNamespace

import pytest
import tolerances
import torch
from trained import capture_then_train

from dflash_trainer.cli import main
from dflash_trainer.commands.eval import unique_labels
from dflash_trainer.config import TargetConfig, load_config
from dflash_trainer.data.blocks import valid_anchor_positions
from dflash_trainer.data.packing import PackedRow, doc_ids_from_positions
from dflash_trainer.data.records import iter_records
from dflash_trainer.drafter_folder import load_drafter, save_drafter
from dflash_trainer.inference.acceptance import EvalInputError, acceptance_report, tau_by_context
from dflash_trainer.inference.regenerate import regenerate_records
from dflash_trainer.model.loading import load_target
from dflash_trainer.model.target import TargetModel
from dflash_trainer.tiny_target.corpus import load_split
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.trainer import build_drafter

B = 4
SMALL = [
    "drafter.num_layers=1",
    f"drafter.block_size={B}",
    "data.seq_len=256",
    "data.max_anchors=32",
    "train.lr=3e-3",
    "train.max_steps=100",
    "train.warmup_ratio=0.05",
]
TRAIN_STEPS = 100


def means_apart(parts: int) -> float:
    """How far two float64 evaluations of one mean of counts (a tau, at most B) may lie apart when one
    combines ``parts`` partial means (each rounded, weighted, summed, divided) and the other divides the
    total: each within gamma_(parts + 3) of the exact ratio."""
    return 2 * tolerances.gamma(parts + 3, torch.float64) * B


def write_regenerated(path, model, tokenizer, n=8, new_tokens=64):
    """Chat records whose answers are the tiny target's own greedy continuations of stdlib code."""
    prompts = path.with_suffix(".prompts.jsonl")
    prompts.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Continue `{f.relpath}`:\n{f.text[:300]}"},
                        {"role": "assistant", "content": ""},
                    ]
                }
            )
            + "\n"
            for f in load_split("train", limit=n)
        )
    )
    records = regenerate_records(
        list(iter_records([str(prompts)])), model, tokenizer, max_new_tokens=new_tokens, batch_size=n, progress=False
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A drafter trained 100 steps on the tiny target's own outputs, saved, an untrained one, and rows.

    The rows are the training rows: 100 CPU steps only make a drafter that accepts more than one
    token on text it has seen, and these tests check the evaluator, not generalization. Trained the way
    a user trains from a feature cache (``capture``, then ``train --set data.features=``, equal to the
    online run bit for bit: test_offline.py): the 7 rows' target forward runs once each instead of at
    every step (the fixture 12.0 and 13.5 CPU-s at one thread against 16.0 and 15.0 with the 100 steps
    online, measured side by side 2026-12-07; 16.4 against 26.8 at two threads)."""
    torch.set_num_threads(min(2, torch.get_num_threads()))  # other work shares this machine
    tmp = tmp_path_factory.mktemp("eval")
    model, tok, _ = load_target(TargetConfig(path="tiny", dtype="float32"))
    data = write_regenerated(tmp / "data.jsonl", model, tok)
    sets = [*SMALL, f"data.train_files=[{data}]", f"data.eval_files=[{data}]", f"output_dir={tmp / 'run'}"]
    once = [f"train.eval_every={TRAIN_STEPS}", f"train.save_every={TRAIN_STEPS}", "data.max_eval_rows=1"]
    capture_then_train([*sets, *once], tmp / "features", "the eval tests' drafter")
    cfg = load_config(["tiny-demo"], sets)
    target, tok, _, eval_rows, _ = prepare(cfg)
    drafter, _ = load_drafter(tmp / "run" / "checkpoints" / f"step-{TRAIN_STEPS:07d}", target)
    trained = save_drafter(drafter, tmp / "a" / "ckpt", target=target, target_path="tiny", extra={"step": TRAIN_STEPS})
    fresh = save_drafter(build_drafter(cfg, target, tok), tmp / "b" / "ckpt", target=target, target_path="tiny")
    return SimpleNamespace(
        tmp=tmp,
        cfg=cfg,
        target=target,
        drafter=drafter.eval(),
        rows=eval_rows,
        data=data,
        trained=trained,
        fresh=fresh,
    )


def test_chain_tau_equals_training_eval(setup):
    # What training's periodic evaluation computes: chain only, the same scorer.
    ref = acceptance_report(
        setup.target, setup.drafter, setup.rows, budgets=(), max_blocks_per_row=16, decode_path=False
    )
    for chunk in (1 << 24, 1):  # all blocks of a row in one projection, and one block at a time
        rep = acceptance_report(
            setup.target, setup.drafter, setup.rows, budgets=(4,), max_blocks_per_row=16, max_logit_elements=chunk
        )
        # the same drafts accepted: tau and the slot acceptances are means of the same counts (integers,
        # summed exactly in float64, then one division), so they are equal, not close
        assert rep["blocks"] == ref["blocks"] > 50
        assert rep["tau"] == ref["tau"]
        assert rep["slot_acceptance"] == ref["slot_acceptance"]
    assert rep["tau"] > 1.3  # the few training steps taught it something: the checks below are not vacuous


def test_report_is_self_consistent(setup):
    budgets = [1, 2, 4, 16, 64]
    rep = acceptance_report(
        setup.target, setup.drafter, setup.rows, budgets=[64, 1, 16, 4, 2, 16], max_blocks_per_row=16
    )
    n, hist = rep["blocks"], rep["accepted_histogram"]
    slot, cond, reach, tau = rep["slot_acceptance"], rep["conditional_acceptance"], rep["reach"], rep["tau"]
    assert rep["budgets"] == budgets  # sorted, duplicates dropped
    assert len(hist) == B and sum(hist) == n and sum(1 for h in hist if h) >= 2
    assert sum(k * h for k, h in enumerate(hist)) / n + 1 == pytest.approx(tau)
    assert sum(reach) + 1 == pytest.approx(tau)
    for k in range(1, B):  # slot k is index k-1
        assert reach[k - 1] == pytest.approx(sum(hist[k:]) / n)
        previous = 1.0 if k == 1 else reach[k - 2]
        assert reach[k - 1] == pytest.approx(previous * cond[k - 1])  # P(>= k) = P(>= k-1) P(k | k-1)
        assert slot[k - 1] >= reach[k - 1] - 1e-12  # accepting slot k needs a match at slot k
    assert cond[0] == pytest.approx(slot[0])
    ddtree = rep["ddtree_tau"]
    assert all(1 <= t <= B for t in ddtree)
    assert all(a <= b + 1e-12 for a, b in zip(ddtree, ddtree[1:]))  # a bigger tree holds the smaller one
    assert ddtree[0] == pytest.approx(1 + slot[0])  # budget 1: the drafter's top token at slot 1 only
    assert ddtree[-1] > tau  # 64 nodes cover more than the single chain for this drafter


def test_tau_by_context_buckets_blocks_by_their_document_position():
    accepted = torch.tensor([0, 3, 1, 2, 0, 5])
    context = torch.tensor([10, 1023, 1024, 5000, 200000, 4095])
    got = tau_by_context(accepted, context)
    assert [(b["context"], b["blocks"]) for b in got] == [("0-1K", 2), ("1K-4K", 2), ("4K-16K", 1), (">=128K", 1)]
    assert [b["tau"] for b in got] == [2.5, 1 + (1 + 5) / 2, 3.0, 1.0]
    assert got[-1]["max"] is None and got[0]["min"] == 0 and got[0]["max"] == 1024


def test_report_splits_tau_by_context_length(setup):
    rep = acceptance_report(
        setup.target, setup.drafter, setup.rows, budgets=(), max_blocks_per_row=16, context_buckets=(0, 32, 64, 128)
    )
    buckets = rep["tau_by_context"]
    assert len(buckets) >= 3 and sum(b["blocks"] for b in buckets) == rep["blocks"]
    assert sum(b["tau"] * b["blocks"] for b in buckets) / rep["blocks"] == pytest.approx(
        rep["tau"], abs=means_apart(len(buckets))
    )
    assert all(b["min"] < (b["max"] or 1 << 62) for b in buckets)


def _brute_force_accepted(log_probs, greedy, budget):
    """Accepted length when the tree is the ``budget`` most probable prefixes, found by enumeration.
    A top-``budget`` prefix only uses per-depth top-``budget`` tokens (each better token at one depth
    gives a more probable prefix of the same depth), so enumerating those is exhaustive."""
    depth = log_probs.shape[0]
    top = [log_probs[d].topk(budget).indices.tolist() for d in range(depth)]
    scored = [
        (sum(log_probs[d, t].item() for d, t in enumerate(p)), p)
        for n in range(1, depth + 1)
        for p in itertools.product(*top[:n])
    ]
    chosen = {p for _, p in sorted(scored, key=lambda s: -s[0])[:budget]}
    n = 0
    while n < depth and tuple(greedy[: n + 1]) in chosen:
        n += 1
    return n


def test_matches_one_block_decoding_and_brute_force_tree(setup):
    """float64, every valid anchor: the report equals a per-block reference built from serving-layout
    drafts (``draft_block``), the target's full logits and an enumerated DDTree."""
    model, _, _ = load_target(TargetConfig(path="tiny", dtype="float32"))
    target = TargetModel(model.double())
    drafter, _ = load_drafter(setup.trained, target, dtype=torch.float64)
    rows = []
    for row in setup.rows[:2]:  # the last 48 tokens of each row's first document (its answer), as a row
        end = int((doc_ids_from_positions(row.position_ids) == 0).sum())
        rows.append(
            PackedRow(
                input_ids=row.input_ids[end - 48 : end],
                position_ids=torch.arange(48),
                loss_mask=row.loss_mask[end - 48 : end],
            )
        )
    budgets = [1, 2, 3, 8]
    chain, trees = [], []
    with torch.no_grad():
        for row in rows:
            logits = model(row.input_ids[None]).logits[0]  # [48, V]: fine for a 48-token reference
            feats = target.features(row.input_ids, need_teacher=False).context
            for a in valid_anchor_positions(row.loss_mask, torch.zeros(48, dtype=torch.long), B).tolist():
                h = drafter.draft_block(int(row.input_ids[a]), a, drafter.context_cache(feats[:a], torch.arange(a)))
                log_probs = torch.log_softmax(drafter.block_logits(h[1:]), -1)  # [B-1, V]
                greedy = logits[a : a + B - 1].argmax(-1).tolist()  # slot k: the target's logits at a + k - 1
                draft = log_probs.argmax(-1).tolist()
                chain.append(next((k for k in range(B - 1) if draft[k] != greedy[k]), B - 1))
                trees.append([_brute_force_accepted(log_probs, greedy, bud) for bud in budgets])
    rep = acceptance_report(target, drafter, rows, budgets=budgets, max_blocks_per_row=1000)
    assert rep["blocks"] == len(chain) > 40
    assert rep["accepted_histogram"] == [chain.count(k) for k in range(B)]
    assert rep["tau"] == pytest.approx(1 + sum(chain) / len(chain), abs=means_apart(1))
    expected = [1 + sum(t[i] for t in trees) / len(trees) for i in range(len(budgets))]
    assert rep["ddtree_tau"] == pytest.approx(expected, abs=means_apart(1))
    assert expected[-1] > expected[0]  # the budgets do differ on these blocks


def test_bad_arguments_and_empty_input(setup):
    args = (setup.target, setup.drafter)
    with pytest.raises(ValueError, match="DDTree budgets must be integers >= 1, got 0"):
        acceptance_report(*args, setup.rows, budgets=(16, 0))
    with pytest.raises(EvalInputError, match="max blocks per row"):
        acceptance_report(*args, setup.rows, max_blocks_per_row=0)
    with pytest.raises(EvalInputError, match="the data set is empty"):
        acceptance_report(*args, [])
    masked = PackedRow(
        input_ids=setup.rows[0].input_ids,
        position_ids=setup.rows[0].position_ids,
        loss_mask=torch.zeros_like(setup.rows[0].loss_mask),
    )
    with pytest.raises(EvalInputError, match=f"no valid block of {B} tokens in 1 evaluation rows"):
        acceptance_report(*args, [masked])


def test_labels_tell_checkpoints_apart(tmp_path):
    assert unique_labels([tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt"]) == ["a/ckpt", "b/ckpt"]
    assert unique_labels([tmp_path / "g4", tmp_path / "g10"]) == ["g4", "g10"]


def test_cli_compares_two_checkpoints(setup, tmp_path, monkeypatch):
    """``eval A B`` from the command line, labelled by their paths relative to the working directory. In
    this process (``cli.main``): eval's refusals run as processes (test_foreign_drafters.py,
    test_hardening_surfaces.py)."""
    from cli_runs import in_process

    out = tmp_path / "report"
    monkeypatch.chdir(tmp_path)
    result = in_process(
        "eval",
        str(setup.trained),
        str(setup.fresh),
        "--data",
        str(setup.data),
        "--out",
        str(out),
        "--budgets",
        "2,8,32",
        "--max-blocks-per-row",
        "8",
        "--set",
        "data.seq_len=128",
        "--temperature",
        "1.0",
        "--sample-prompts",
        "2",
        "--max-new-tokens",
        "12",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert [e["label"] for e in report["checkpoints"]] == ["a/ckpt", "b/ckpt"]
    assert report["budgets"] == [2, 8, 32] and report["target"] == "tiny"
    trained, fresh = (e["report"] for e in report["checkpoints"])
    assert trained["blocks"] == fresh["blocks"] > 0  # same rows, same anchors
    assert trained["tau"] > fresh["tau"]
    assert "a/ckpt" in result.stdout and "T@32" in result.stdout
    for r in (trained, fresh):  # tau(T=1) both ways, chain and every budget
        sampled = r["sampling"]
        assert sampled["temperature"] == 1.0 and sampled["top_p"] == 1.0
        ex, me = sampled["expected"], sampled["measured"]
        assert ex["blocks"] == r["blocks"] and ex["budgets"] == me["budgets"] == [2, 8, 32]
        assert all(1.0 <= t <= B for t in [ex["tau"], *ex["ddtree_tau"]])
        assert me["prompts"] == 2 and me["chain"]["rounds"] > 0 and len(me["ddtree"]) == 3
        assert all(1.0 <= m["tau"] <= B for m in [me["chain"], *me["ddtree"]])
    assert trained["sampling"]["expected"]["tau"] > fresh["sampling"]["expected"]["tau"]
    assert "T=1 chain tau expected" in result.stdout
    from matplotlib.image import imread

    for name in ("acceptance_per_slot.png", "tau_vs_budget.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert imread(out / name).shape[0] > 200
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


def _edit_checkpoint(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    meta = json.loads((dst / "drafter_config.json").read_text())
    edit(meta)
    (dst / "drafter_config.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize(
    "case, needle",
    [
        ("hidden", "hidden size 128 != target's 256"),
        ("vocab", "vocabulary 4096 != target's 8192"),
        ("layer_ids", "layer ids [20] outside the target's 0..7"),
        ("layer_count", "trained on a 16-layer target, this one has 8 layers"),
        ("config_layer_ids", "trained on target layer ids [1, 2, 3, 4, 5], the config asks for [0, 1, 2, 3, 4]"),
        ("block", "block size 1 < 2"),
        ("budget", "--budgets must be integers >= 1, got '16,0'"),
        ("max_blocks", "--max-blocks-per-row must be integers >= 1"),
        ("empty_data", "no records in"),
        ("no_block", "no usable document among 2 records"),
        ("two_targets", "the checkpoints were trained for different targets"),
        ("not_a_checkpoint", "is not a drafter checkpoint"),
        ("temperature", "--temperature must be >= 0, got -0.5"),
        ("top_p", "--top-p must be in (0, 1], got 0.0"),
        ("sample_prompts", "--sample-prompts must be integers >= 1"),
    ],
)
def test_bad_input_is_one_clear_line(setup, tmp_path, capsys, case, needle):
    ckpts, extra, data = [setup.trained], [], setup.data
    edits = {
        "hidden": lambda m: m["spec"].update(hidden_size=128),
        "vocab": lambda m: m["spec"].update(vocab_size=4096),
        "layer_ids": lambda m: m["target"].update(layer_ids=[1, 2, 3, 4, 20]),
        "layer_count": lambda m: m["target"].update(num_layers=16),
        "block": lambda m: m["spec"].update(block_size=1),
    }
    if case in edits:
        ckpts = [_edit_checkpoint(setup.trained, tmp_path / "bad", edits[case])]
    elif case == "config_layer_ids":
        extra = ["--set", "target.layer_ids=[0,1,2,3,4]"]
    elif case == "budget":
        extra = ["--budgets", "16,0"]
    elif case == "max_blocks":
        extra = ["--max-blocks-per-row", "-3"]
    elif case == "temperature":
        extra = ["--temperature", "-0.5"]
    elif case == "top_p":
        extra = ["--temperature", "1", "--top-p", "0"]
    elif case == "sample_prompts":
        extra = ["--temperature", "1", "--sample-prompts", "0"]
    elif case == "empty_data":
        data = tmp_path / "empty.jsonl"
        data.write_text("")
    elif case == "no_block":  # every document shorter than one block
        data = tmp_path / "short.jsonl"
        data.write_text('{"input_ids": [5, 6], "loss_mask": [1, 1]}\n{"input_ids": [7], "loss_mask": [1]}\n')
    elif case == "two_targets":
        other = _edit_checkpoint(setup.trained, tmp_path / "other", lambda m: m["target"].update(path="/x"))
        ckpts = [setup.trained, other]
    elif case == "not_a_checkpoint":
        ckpts = [tmp_path]
    out = tmp_path / "out"
    code = main(["eval", *map(str, ckpts), "--data", str(data), "--out", str(out), "--set", "data.seq_len=128", *extra])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-train: error: "), err
    assert needle in lines[0]
    assert not (out / "report.json").exists()


def test_benchmarks_are_scored_each_and_overall_with_prompts_answered_by_the_target(setup, tmp_path):
    """``--benchmark`` twice: full chats (setup.data), and prompts only (a ``question`` column, as gsm8k
    has) that the target answers first. Each set gets every figure, the overall line is each figure's
    mean over all the sets' blocks (rounds), and the prompts-only set's answers are the target's own
    greedy continuations (regenerate's code, run here separately on the same prompts)."""
    from cli_runs import in_process

    questions = [f"Continue `{f.relpath}`:\n{f.text[:200]}" for f in load_split("train", limit=12)[8:12]]
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "question": q}) + "\n" for i, q in enumerate(questions)))
    out = tmp_path / "report"
    done = in_process(
        "eval",
        str(setup.trained),
        str(setup.fresh),
        "--benchmark",
        f"chats={setup.data}",
        "--benchmark",
        f"questions={prompts}",
        "--prompt-key",
        "question",
        "--out",
        str(out),
        "--budgets",
        "2,8",
        "--max-blocks-per-row",
        "8",
        "--set",
        "data.seq_len=128",
        "--sample-prompts",
        "2",
        "--max-new-tokens",
        "24",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["temperature"] == 1.0  # with --benchmark, T = 0 and T = 1 by default
    chats, asked = report["benchmarks"]
    assert (chats["name"], chats["generated"], asked["name"], asked["generated"]) == ("chats", 0, "questions", 4)

    answered = [json.loads(line) for line in (out / "benchmarks" / "questions.jsonl").read_text().splitlines()]
    chat_prompts = tmp_path / "chat_prompts.jsonl"
    chat_prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ""}]}) + "\n"
            for q in questions
        )
    )
    model, tok, _ = load_target(TargetConfig(path="tiny", dtype="float32"))
    reference = regenerate_records(
        list(iter_records([str(chat_prompts)])), model, tok, max_new_tokens=24, batch_size=8, progress=False
    )
    assert [r["messages"] for r in answered] == [r["messages"] for r in reference]
    assert [r["id"] for r in answered] == [0, 1, 2, 3]  # the input's other columns are kept

    for label in ("a/ckpt", "b/ckpt"):
        parts = [next(e["report"] for e in b["checkpoints"] if e["label"] == label) for b in (chats, asked)]
        total = report["overall"][label]
        blocks = [p["blocks"] for p in parts]
        assert total["blocks"] == sum(blocks) and min(blocks) > 0
        apart = means_apart(len(parts))
        assert total["tau"] == pytest.approx(sum(p["tau"] * n for p, n in zip(parts, blocks)) / sum(blocks), abs=apart)
        rounds = [p["decode_rounds"] for p in parts]
        assert total["decode_tau"] == pytest.approx(
            sum(p["decode_tau"] * n for p, n in zip(parts, rounds)) / sum(rounds), abs=apart
        )
        for i in range(2):
            assert total["ddtree_tau"][i] == pytest.approx(
                sum(p["ddtree_tau"][i] * n for p, n in zip(parts, blocks)) / sum(blocks), abs=apart
            )
        measured = [p["sampling"]["measured"]["chain"] for p in parts]
        assert total["sampling"]["measured_tau"] == pytest.approx(
            sum(m["tau"] * m["rounds"] for m in measured) / sum(m["rounds"] for m in measured), abs=apart
        )
        assert all(1.0 <= t <= B for t in [total["tau"], total["decode_tau"], *total["ddtree_tau"]])
    trained, fresh = (e["report"] for e in chats["checkpoints"])
    assert trained["tau"] > fresh["tau"]  # the chats are the trained drafter's own training text
    lines = done.stdout.splitlines()
    assert any(line.startswith("overall") and "a/ckpt" in line for line in lines)
    assert any("T=1 meas" in line for line in lines)
    from matplotlib.image import imread

    assert imread(out / "tau_by_benchmark.png").shape[0] > 200


@pytest.mark.parametrize(
    "case, needle",
    [
        ("no_equals", "--benchmark takes NAME=PATH"),
        ("missing", "no such file or folder"),
        ("both", "with --data, or named sets with --benchmark"),
        ("twice", "--benchmark a is given twice"),
        ("no_prompt", "no usable record (no messages, conversations or input_ids)"),
    ],
)
def test_bad_benchmark_input_is_one_clear_line(setup, tmp_path, capsys, case, needle):
    good = f"a={setup.data}"
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "what?"}\n')
    specs = {
        "no_equals": ["--benchmark", "gsm8k"],
        "missing": ["--benchmark", f"a={tmp_path / 'nope.jsonl'}"],
        "both": ["--benchmark", good, "--data", str(setup.data)],
        "twice": ["--benchmark", good, "--benchmark", good],
        "no_prompt": ["--benchmark", f"b={wrong}"],  # --prompt-key is "prompt": this set has "question"
    }[case]
    code = main(["eval", str(setup.trained), *specs, "--out", str(tmp_path / "out"), "--set", "data.seq_len=128"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
