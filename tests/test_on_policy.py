"""The on-policy stage (``train --stage on-policy``, training/on_policy.py) on the tiny target, starting
from the session's shared SFT drafter (tests/trained.py):

- a rollout is lossless (its text is the target's greedy text) and recording it changes no round;
- the teacher rows it records from the verification pass are the target's final hidden states over the
  anchor and the drafts, as a separate target forward computes them (within the float32 bound of two
  kernels' orders), and its slot weights and accepted flags follow the rounds' accepted counts;
- DDTree rollouts are lossless too, their rounds are real DDTree decoding's, and a slot counts as
  accepted up to the accepted path's depth;
- a run from the SFT drafter logs its rollouts, and a resumed run reproduces the uninterrupted run's
  losses bit for bit (rollouts sampled at T = 1, seeded by the row); a DDTree run trains;
- settings the stage does not support are refused in one line.
"""

import json
import math

import pytest
import tolerances
import torch
from cli_runs import in_process
from trained import EOS, train_on_greedy

from dflash_trainer.config import load_config
from dflash_trainer.inference.speculative import SpeculativeDecoder
from dflash_trainer.training.on_policy import collect_rollout, rollout_features, slot_weights

NEW_TOKENS = 48
TREE_PLAN = ["train.stage=on_policy", "on_policy.rollout=ddtree", "on_policy.budget=24"]


@pytest.fixture(scope="module")
def trained():
    return train_on_greedy()


def test_a_rollout_is_lossless_and_records_the_targets_states(trained):
    target, drafter = trained["target"], trained["drafter"]
    overrides = [f"on_policy.max_new_tokens={NEW_TOKENS}", "train.stage=on_policy", "on_policy.teacher=verified"]
    cfg = load_config(["tiny-demo"], overrides)
    block, hidden = drafter.spec.block_size, target.lm_head_weight.shape[1]
    # the float32 bound of two evaluations of the 8-layer target in different orders (incremental with a
    # cache, against one forward over the whole prefix), relative to the states' magnitude
    bound = tolerances.float32_forward_error(layers=8, inner=4 * hidden)
    rejected_somewhere = False
    for prompt, greedy in zip(trained["prompts"][:3], trained["greedy"]):
        plain = SpeculativeDecoder(target, drafter, EOS).generate(prompt, NEW_TOKENS)
        drafter.train()
        rollout = collect_rollout(target, drafter, prompt, EOS, cfg, row_index=0)
        assert drafter.training  # drafting ran in eval mode, then the training mode came back
        drafter.eval()
        n = rollout.anchors.numel()
        text = rollout.input_ids[rollout.loss_mask.bool()].tolist()
        assert text == plain.tokens == greedy[: len(text)]  # lossless, and recording changed nothing
        assert rollout.accepted_counts == plain.accepted[:n] and rollout.anchors.tolist() == plain.anchors[:n]
        assert math.isclose(rollout.tau, sum(a + 1 for a in plain.accepted[:n]) / n)
        teacher = rollout.teacher.view(n, block, hidden)
        for r, (anchor, accepted) in enumerate(zip(rollout.anchors.tolist(), rollout.accepted_counts)):
            drafts = rollout.drafts[r]
            after = text[anchor - len(prompt) + 1 :][:accepted]  # the text past the anchor (cut at the end)
            assert len(drafts) == block - 1 and drafts[: len(after)] == after
            # the block as verification fed it: the text up to the anchor, then the drafts
            ids = torch.cat([rollout.input_ids[: anchor + 1], torch.tensor(drafts[:-1])])
            want = target.features(ids).last_hidden[anchor:]  # [B-1, H]: after the anchor and drafts < k
            got = teacher[r, 1:]
            assert (got - want).abs().max().item() <= bound * want.abs().max().item()
            assert teacher[r, 0].abs().max().item() == 0.0  # slot 0 has no loss, and no teacher
            acc, w = slot_weights(accepted, block, cfg.loss.gamma)
            assert torch.equal(rollout.accepted.view(n, block)[r], acc)
            assert torch.equal(rollout.weights.view(n, block)[r], w)
            rejected_somewhere |= accepted < block - 1
    assert rejected_somewhere  # the check saw rejected slots, whose states only the drafts lead to


def test_the_text_and_the_verified_teachers_agree_up_to_the_first_rejected_slot(trained):
    """``on_policy.teacher``: the target's states along the decoded text and the verification pass's
    states after the drafts are the same states up to the first rejected slot (the drafts before it are
    the text), and differ after it (a wrong draft before them); a slot past the text has no weight."""
    target, drafter = trained["target"], trained["drafter"]
    cfgs = {
        name: load_config(["tiny-demo"], ["train.stage=on_policy", f"on_policy.teacher={name}"])
        for name in ("text", "verified")
    }
    block, hidden = drafter.spec.block_size, target.lm_head_weight.shape[1]
    bound = tolerances.float32_forward_error(layers=8, inner=4 * hidden)
    differ = 0
    for prompt in trained["prompts"][:2]:
        rollout = collect_rollout(target, drafter, prompt, EOS, cfgs["verified"], row_index=0)
        n = rollout.anchors.numel()
        (text, w_text), (verified, w_verified) = (rollout_features(target, rollout, c, n) for c in cfgs.values())
        assert torch.equal(text.context, verified.context) and torch.equal(w_verified, rollout.weights)
        t, v = text.teacher.view(n, block, hidden), verified.teacher.view(n, block, hidden)
        end = int(rollout.loss_mask.nonzero().max()) + 1  # prompt + generated tokens
        for r, (anchor, accepted) in enumerate(zip(rollout.anchors.tolist(), rollout.accepted_counts)):
            for k in range(1, block):
                if anchor + k >= end:  # past the decoded text: no continuation to learn
                    assert w_text[r * block + k] == 0.0
                    continue
                gap = (t[r, k] - v[r, k]).abs().max().item()
                if k <= accepted + 1:
                    assert gap <= bound * v[r, k].abs().max().item()
                else:
                    differ += gap > 100 * bound * v[r, k].abs().max().item()
    assert differ > 0  # slots after a wrong draft: the two teachers are different states


def test_a_ddtree_rollout_is_lossless_and_its_rounds_are_ddtree_decodings(trained):
    """``on_policy.rollout=ddtree``: the rollout's text is the target's greedy text, its rounds (anchors,
    accepted path depths) are plain DDTree decoding's at the same budget, and its accepted flags and
    slot weights follow the path depths; the text teacher reads past the chain's first rejection where
    the tree accepted more (rounds that accept more than the greedy chain's agreeing prefix exist)."""
    target, drafter = trained["target"], trained["drafter"]
    overrides = [f"on_policy.max_new_tokens={NEW_TOKENS}", "on_policy.rollout=ddtree", "on_policy.budget=12"]
    cfg = load_config(["tiny-demo"], ["train.stage=on_policy", *overrides])
    block = drafter.spec.block_size
    beyond_chain = 0
    for prompt, greedy in zip(trained["prompts"][:3], trained["greedy"]):
        plain = SpeculativeDecoder(target, drafter, EOS).generate(prompt, NEW_TOKENS, "ddtree", budget=12)
        rollout = collect_rollout(target, drafter, prompt, EOS, cfg, row_index=0)
        n = rollout.anchors.numel()
        text = rollout.input_ids[rollout.loss_mask.bool()].tolist()
        assert text == plain.tokens == greedy[: len(text)]
        assert rollout.accepted_counts == plain.accepted[:n] and rollout.anchors.tolist() == plain.anchors[:n]
        assert rollout.teacher is None  # a tree records no verified teacher
        for r, (anchor, accepted) in enumerate(zip(rollout.anchors.tolist(), rollout.accepted_counts)):
            acc, w = slot_weights(accepted, block, cfg.loss.gamma)
            assert torch.equal(rollout.accepted.view(n, block)[r], acc)
            assert torch.equal(rollout.weights.view(n, block)[r], w)
            after = text[anchor - len(prompt) + 1 :]
            chain_prefix = next((k for k, (d, t) in enumerate(zip(rollout.drafts[r], after)) if d != t), len(after))
            beyond_chain += accepted > chain_prefix
    assert beyond_chain > 0  # the tree accepted a slot the greedy chain would have rejected


def test_slot_weights_decay_from_the_first_rejected_slot():
    acc, w = slot_weights(2, 6, gamma=4.0)
    assert acc.tolist() == [False, True, True, False, False, False]
    want = [0.0, 1.0, math.exp(-1 / 4), 1.0, math.exp(-1 / 4), math.exp(-2 / 4)]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(w.tolist(), want))


def run_args(trained, out, *extra):
    args = ["train", "--config", "tiny-demo", "--no-progress", "--stage", "on-policy"]
    for item in (
        f"data.train_files=[{trained['root'] / 'data.jsonl'}]",
        f"output_dir={out}",
        f"drafter.init_from={trained['ckpt']}",
        "data.max_eval_rows=1",
        "train.log_every=1",
        "train.eval_every=4",
        "train.save_every=2",
        "train.max_steps=4",
        "on_policy.max_new_tokens=32",
        "on_policy.temperature=1.0",
        *extra,
    ):
        args += ["--set", item]
    return args


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_on_policy_run_logs_its_rollouts_and_resumes_bit_identically(trained, tmp_path):
    whole = in_process(*run_args(trained, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    rows = metrics(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1.0 <= r["rollout_tau"] <= 8.0 and 0.0 <= r["accepted_share"] <= 1.0
        assert r["forward_kl"] >= 0.0 and r["reverse_kl"] >= 0.0 and math.isfinite(r["loss"])
    # it started from the SFT drafter (whose greedy drafts the target's T = 1 samples rarely follow on
    # this tiny target: rollout tau about 1.05; test_a_rollout_is_lossless... checks greedy rollouts)
    assert f"drafter: starting from the weights of {trained['ckpt']}" in whole.stdout
    target_tokens = [r["rollout_target_tokens"] for r in rows]
    assert target_tokens == sorted(target_tokens) and target_tokens[0] > 32  # counted, and growing
    assert any(r["reverse_kl"] > 0 for r in rows)  # rejected slots were trained on
    # steps 3 and 4 again, from the step-2 checkpoint (drafter, optimizer, RNG and counters)
    resumed = in_process(
        *run_args(trained, tmp_path / "resumed"), "--resume", str(tmp_path / "whole/checkpoints/step-0000002")
    )
    assert resumed.returncode == 0, resumed.stderr
    again = metrics(tmp_path / "resumed")
    keys = ("step", "loss", "forward_kl", "reverse_kl", "rollout_tau", "grad_norm", "rollout_target_tokens")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in rows[2:]]


def test_a_ddtree_on_policy_run_trains_on_its_rounds(trained, tmp_path):
    """Two greedy steps with DDTree rollouts: the rounds' path depths are the logged rollout tau, and
    the rejected slots past them are trained on."""
    done = in_process(
        *run_args(trained, tmp_path / "tree"),
        *("--set", "on_policy.rollout=ddtree", "--set", "on_policy.temperature=0", "--set", "train.max_steps=2"),
    )
    assert done.returncode == 0, done.stderr
    rows = metrics(tmp_path / "tree")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(1.0 <= r["rollout_tau"] <= 8.0 and math.isfinite(r["loss"]) for r in rows)
    assert any(r["reverse_kl"] > 0 for r in rows) and any(r["forward_kl"] > 0 for r in rows)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["drafter.variant=dspark"], "train.stage=on_policy trains DFlash drafters, not drafter.variant=dspark"),
        (["data.features=/nowhere"], "train.stage=on_policy decodes with the target as it trains"),
        (["topology.target_ranks=2", "topology.drafter_ranks=2"], "trains on one drafter rank"),
        (["on_policy.temperature=-1"], "on_policy.temperature"),
        (["on_policy.rollout=ddtree", "on_policy.teacher=verified"], "use on_policy.teacher=text with"),
    ],
)
def test_unsupported_on_policy_settings_are_one_line(trained, tmp_path, extra, message):
    done = in_process(*run_args(trained, tmp_path / "bad", *extra))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_the_planner_prices_the_rollout(trained):
    """``plan`` of an on-policy run has a rollout phase; its KV cache item is what the target's cache
    really holds after the longest rollout (a row's prompt + max_new_tokens + a block), measured on the
    tiny target's own ``DynamicCache``; an SFT run has no such phase."""
    from transformers import DynamicCache

    from dflash_trainer.inference.speculative import _forward_cache_kwarg
    from dflash_trainer.planner import plan_for_config

    cfg = load_config(["tiny-demo"], ["train.stage=on_policy", "on_policy.max_new_tokens=40"])
    device = plan_for_config(cfg).devices[0]
    assert "rollout" in device.phases and "rollout" not in plan_for_config(load_config(["tiny-demo"])).devices[0].phases
    items = {i.name: i.bytes for i in device.items}
    positions = cfg.data.seq_len + 40 + cfg.drafter.block_size
    model = trained["target"].model
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        ids = torch.randint(5, 100, (1, positions))
        model.model(input_ids=ids, use_cache=True, **{_forward_cache_kwarg(model.model): cache})
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert items["rollout KV cache (target)"] == held
    assert device.phases["rollout"] >= held + items["rollout teacher rows"]
    # DDTree rollouts: one pass over the anchor and budget nodes (logits [1 + budget, V]) with an
    # additive ancestor mask over the rollout's positions, and no recorded teacher rows
    tree_cfg = load_config(["tiny-demo"], [*TREE_PLAN, "on_policy.max_new_tokens=40"])
    tree = {i.name: i.bytes for i in plan_for_config(tree_cfg).devices[0].items}
    assert "rollout teacher rows" not in tree
    t = held // sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))  # target dtype
    vocab = model.config.vocab_size
    assert tree["rollout tree mask"] == (1 + 24) * positions * t
    extra_rows = (1 + 24) - cfg.drafter.block_size
    assert tree["rollout verification pass"] - items["rollout verification pass"] >= extra_rows * vocab * t
    # with target ranks the rollout is the target rank's: it keeps the whole target (it verifies) and a
    # copy of the drafter's weights (it drafts); the drafter rank has no rollout phase
    ranks = ["train.stage=on_policy", "on_policy.max_new_tokens=40", "topology.target_ranks=1"]
    target_rank, drafter_rank = plan_for_config(load_config(["tiny-demo"], ranks)).devices
    sft_rank = plan_for_config(load_config(["tiny-demo"], ["topology.target_ranks=1"])).devices[0]
    on = {i.name: i.bytes for i in target_rank.items}
    assert "rollout" in target_rank.phases and "rollout" not in drafter_rank.phases and "rollout" not in sft_rank.phases
    assert on["rollout KV cache (target)"] == held
    assert on["drafter weights (fp32)"] == items["drafter weights (fp32)"]
    assert (
        on["target weights"] == items["target weights"] >= {i.name: i.bytes for i in sft_rank.items}["target weights"]
    )
