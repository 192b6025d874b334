"""DSpark on the shared backbone (variants/dspark/): the slot -> token mapping, the heads, the
training step against the plain reference, training end to end, the Markov walk at inference and
lossless greedy decoding."""

import pytest
import tolerances
import torch
from test_train import SMALL, fused_and_reference_in_float64, losses, write_data

from dflash_trainer.config import load_config
from dflash_trainer.drafter_folder import load_drafter
from dflash_trainer.inference.acceptance import acceptance_report
from dflash_trainer.inference.speculative import SpeculativeDecoder, target_greedy
from dflash_trainer.model.target import TargetModel
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.step import drafter_step, needs_teacher, produce_row_features
from dflash_trainer.training.trainer import Trainer
from dflash_trainer.variants import block_span, variant_of
from dflash_trainer.variants.dspark.modules import MarkovHead


def dspark_config(tmp_path, data, *extra):
    return load_config(
        ["tiny-demo"],
        [
            *SMALL,
            f"data.train_files=[{data}]",
            f"output_dir={tmp_path / 'run'}",
            "drafter.variant=dspark",
            "drafter.dspark.markov_rank=16",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark")
    data = write_data(tmp / "data.jsonl", n=24)
    cfg = dspark_config(tmp, data, "train.max_steps=40", "train.eval_every=40", "train.save_every=40")
    target, tok, train_rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, train_rows, eval_rows, out_dir=tmp / "run", target_path="tiny", progress=False)
    before = trainer.evaluate()
    after = trainer.fit()
    return dict(tmp=tmp, data=data, cfg=cfg, target=target, tok=tok, rows=eval_rows, before=before, after=after)


def test_dflash_is_the_default_and_its_spec_json_is_unchanged(tmp_path):
    cfg = load_config(["tiny-demo"], [])
    assert cfg.drafter.variant == "dflash" and cfg.drafter.block_span == cfg.drafter.block_size
    from dflash_trainer.model.drafter import DrafterSpec

    spec = DrafterSpec(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, vocab_size=32)
    assert "variant" not in spec.to_dict() and "variant_options" not in spec.to_dict()
    assert DrafterSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("from_anchor", [True, False])
def test_slot_to_token_mapping(tmp_path, from_anchor):
    """sample_from_anchor: slot k predicts x[P+k+1] with prev x[P+k] (B drafts); else slot k >= 1
    predicts x[P+k] with prev x[P+k-1] (B - 1 drafts). Labels, teacher rows and prev ids of one step."""
    data = write_data(tmp_path / "data.jsonl", n=4)
    cfg = dspark_config(
        tmp_path, data, f"drafter.dspark.sample_from_anchor={str(from_anchor).lower()}", "loss.kl_weight=0.5"
    )
    target, tok, rows, _, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    spec, b = trainer.drafter.spec, cfg.drafter.block_size
    assert block_span(spec) == b + int(from_anchor) == cfg.drafter.block_span
    feats = produce_row_features(target, rows[0], 0, cfg)
    batch = drafter_step(trainer.drafter, feats, cfg, train=False)
    ids, full = rows[0].input_ids, target.features(rows[0].input_ids, rows[0].position_ids, need_teacher=True)
    n = feats.anchors.numel()
    labels, weights = batch.labels.view(-1, b), batch.weights.view(-1, b)
    prev, teacher = batch.extras["prev_ids"].view(-1, b), batch.teacher.view(-1, b, batch.teacher.shape[-1])
    shift = int(from_anchor)
    for i, p in enumerate(feats.anchors.tolist()):
        for k in range(b):
            if weights[i, k] > 0:
                assert labels[i, k] == ids[p + k + shift]
                assert prev[i, k] == ids[p + k + shift - 1]
                assert torch.allclose(teacher[i, k], full.last_hidden[p + k + shift - 1].to(teacher.dtype))
    assert (weights[:n, 0] > 0).any() == from_anchor  # the anchor slot predicts only with sample_from_anchor
    assert (weights[n:] == 0).all()


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_training_step_matches_the_reference_loss(tmp_path, head_type):
    data = write_data(tmp_path / "data.jsonl", n=4)
    cfg = dspark_config(
        tmp_path,
        data,
        f"drafter.dspark.markov_head_type={head_type}",
        "drafter.dspark.renyi_weight=0.3",
        "drafter.dspark.position_weights=dpard",
        "loss.position_weights=exp_decay",  # D-PARD's credit replaces these weights (D-PACE's would too)
        "loss.kl_weight=0.2",
    )
    assert needs_teacher(cfg)
    target, tok, rows, _, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    d = trainer.drafter
    torch.nn.init.normal_(d.markov_head.markov_w1.weight, std=0.5)  # a bias large enough to matter
    params = [
        d.fc.weight,
        d.markov_head.markov_w1.weight,
        d.markov_head.markov_w2.weight,
        d.confidence_head.proj.weight,
    ]
    metrics = fused_and_reference_in_float64(target, d, rows[0], cfg, params)
    assert 0 < metrics["accept"].item() < 1 and metrics["confidence_bce"].item() > 0


def test_markov_head_features_match_speculators_formulas():
    """The three head types against their definitions (speculators' MarkovHead.block_bias), written out."""
    torch.manual_seed(0)
    for head_type in ("vanilla", "gated", "rnn"):
        head = MarkovHead(20, 4, 6, head_type).double()
        prev, hidden = torch.randint(0, 20, (3, 5)), torch.randn(3, 5, 6, dtype=torch.float64)
        feat, emb = head.features(prev, hidden)
        e = head.markov_w1.weight[prev]
        if head_type == "vanilla":
            want = e
        elif head_type == "gated":
            want = torch.sigmoid(head.gate_proj(torch.cat([hidden, e], -1))) * e
        else:
            state, outs = torch.zeros(3, 4, dtype=torch.float64), []
            for k in range(5):
                gate, cand, out = head.joint_proj(torch.cat([state, e[:, k], hidden[:, k]], -1)).chunk(3, -1)
                state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
                outs.append(torch.tanh(out))
            want = torch.stack(outs, 1)
        assert torch.allclose(feat, want) and torch.equal(emb, e)


def test_dspark_trains_end_to_end(small_run):
    steps = losses(small_run["tmp"] / "run")
    first, last = sum(steps[s] for s in range(1, 6)) / 5, sum(steps[s] for s in range(36, 41)) / 5
    assert last < first - 0.5, (first, last)
    assert small_run["after"]["tau"] > small_run["before"]["tau"]


def test_checkpoint_roundtrip_and_chain_decoding_is_lossless(small_run):
    target = small_run["target"]
    ckpt = small_run["tmp"] / "run" / "checkpoints" / "step-0000040"
    drafter, meta = load_drafter(ckpt, target)
    assert meta["spec"]["variant"] == "dspark" and hasattr(drafter, "markov_head")
    eos = [0, 2]
    row = small_run["rows"][0]
    prompt = row.input_ids[:40].tolist()
    plain = SpeculativeDecoder(target, drafter, eos)
    n = 48
    greedy, _ = target_greedy(target.model, prompt, n, eos)
    for mode in ("chain", "ddtree"):
        out = plain.generate(prompt, n, mode=mode, budget=16)
        assert out.tokens == greedy, mode
        assert max(out.drafted) == drafter.spec.block_size  # sample_from_anchor: B drafts a block
    for threshold in (0.3, 0.7):  # the confidence head stops blocks early; the output stays the target's
        out = SpeculativeDecoder(target, drafter, eos, confidence_threshold=threshold).generate(prompt, n)
        assert out.tokens == greedy and min(out.drafted) >= 1
    # a cumulative product of probabilities < 1 is always below 1.0: every block stops after one draft
    out = SpeculativeDecoder(target, drafter, eos, confidence_threshold=1.0).generate(prompt, n)
    assert out.tokens == greedy and set(out.drafted) == {1}


def test_teacher_forced_tau_equals_the_decode_walk(small_run):
    """The eval's chain tau at the decode path is what speculative decoding measures, for DSpark too."""
    target, drafter = (
        small_run["target"],
        load_drafter(small_run["tmp"] / "run" / "checkpoints" / "step-0000040", small_run["target"])[0],
    )
    report = acceptance_report(target, drafter, small_run["rows"][:2], budgets=[16], max_blocks_per_row=8)
    assert len(report["slot_acceptance"]) == drafter.spec.block_size
    assert 1.0 <= report["tau"] <= drafter.spec.block_size + 1
    assert variant_of(drafter.spec).name == "dspark"


def test_planner_prices_the_heads_their_optimizer_state_and_the_loss_workspace(small_run):
    """The planner's head parameters are the drafter's real ones, and DSpark's plan adds weights,
    AdamW state and loss workspace to DFlash's."""
    from dflash_trainer.planner import formulas as F
    from dflash_trainer.planner.report import workload_from_config

    cfg = small_run["cfg"]
    drafter = load_drafter(small_run["tmp"] / "run" / "checkpoints" / "step-0000040", small_run["target"])[0]
    heads = sum(p.numel() for n, p in drafter.named_parameters() if n.startswith(("markov_head", "confidence_head")))
    w = workload_from_config(cfg)
    spec = drafter.spec
    dims = F.DrafterDims(
        spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size, spec.vocab_size
    )
    assert F.variant_head_params(w, dims)[0] == heads > 0
    assert w.loss_rows == cfg.data.max_anchors * cfg.drafter.block_size  # the anchor slot predicts too
    plain = workload_from_config(
        load_config(["tiny-demo"], [f"data.max_anchors={cfg.data.max_anchors}", "drafter.block_size=4"])
    )
    ws, ws0 = (sum(F.loss_workspace(x, spec.vocab_size, spec.hidden_size, 64).values()) for x in (w, plain))
    assert ws > ws0


def test_speculate_cli_with_a_confidence_threshold_reports_target_tokens_saved(small_run, tmp_path):
    """The command in this process (tests/cli_runs.py; speculate as a process: test_speculative.py)."""
    import json

    from cli_runs import in_process

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(small_run["data"].read_text().splitlines()[0] + "\n")
    ckpt = small_run["tmp"] / "run" / "checkpoints" / "step-0000040"
    base = ["speculate", "--drafter", str(ckpt), "--input", str(prompts)]
    reports = {}
    for c in ("0", "0.9"):
        out = tmp_path / f"spec-{c}.jsonl"
        run = in_process(*base, "--output", str(out), "--max-new-tokens", "24", "--confidence-threshold", c)
        assert run.returncode == 0, run.stderr
        reports[c] = json.loads(out.with_name(out.name + ".report.json").read_text())["modes"]["chain"]
        assert reports[c]["mismatches"] == 0
    assert reports["0"]["target_tokens_saved"] == 0
    assert reports["0.9"]["target_tokens_saved"] > 0
    assert reports["0.9"]["drafts_per_round"] < reports["0"]["drafts_per_round"]


def test_conditioned_tree_holds_the_most_probable_prefixes():
    """build_conditioned_tree against brute force on a random Markov chain (children depend on the
    parent's token), and equal to build_tree when they do not."""
    import itertools

    from dflash_trainer.inference.ddtree import build_conditioned_tree, build_tree

    g = torch.Generator().manual_seed(0)
    v, depth, budget = 5, 3, 12
    first = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)
    trans = torch.log_softmax(torch.randn(depth, v, v, generator=g, dtype=torch.float64), -1)  # [depth, prev, next]
    tree = build_conditioned_tree((first, None), lambda tok, state, d: (trans[d][tok], None), depth, budget)
    scores = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(v), repeat=d):
            lp = first[path[0]] + sum(trans[j + 1][path[j]][path[j + 1]] for j in range(d - 1))
            scores[path] = float(lp)
    best = sorted(scores.values(), reverse=True)[:budget]
    assert sorted(tree.logprobs, reverse=True) == pytest.approx(best)
    for i in range(len(tree)):  # every node's recorded log-probability is its path's
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        assert scores[tuple(reversed(path))] == pytest.approx(tree.logprobs[i])
    marg = torch.log_softmax(torch.randn(depth, v, generator=g, dtype=torch.float64), -1)
    plain = build_tree(marg, budget)
    same = build_conditioned_tree((marg[0], None), lambda tok, state, d: (marg[d], None), depth, budget)
    assert same.tokens == plain.tokens and same.parents == plain.parents


def test_dspark_tree_extends_the_walk(small_run):
    """The DDTree's rank-0 path is the Markov walk's greedy chain, and children follow their parent's token."""
    from dflash_trainer.inference.ddtree import build_conditioned_tree

    target = small_run["target"]
    drafter = load_drafter(small_run["tmp"] / "run" / "checkpoints" / "step-0000040", target)[0]
    v = variant_of(drafter.spec)
    ids = small_run["rows"][0].input_ids
    a = 30
    feats = target.features(ids[:a], torch.arange(a), need_teacher=False).context
    hidden = drafter.draft_block(int(ids[a]), a, drafter.context_cache(feats, torch.arange(a)))
    _, drafts = v.propose(drafter, hidden, int(ids[a]))
    tree = build_conditioned_tree(*v.tree_expansion(drafter, hidden, int(ids[a])), len(drafts), 64)
    assert len(tree) == 64
    node, followed = -1, 0
    for tok in drafts:  # each node's best child is the walk's next draft given that node's token
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            break
        assert tree.tokens[min(kids)] == tok
        node, followed = min(kids), followed + 1
    assert followed >= 2


def test_eval_ddtree_is_the_tree_decoding_verifies(small_run):
    """Eval's DDTree of a DSpark block is the tree DDTree decoding builds and verifies at that anchor
    (node-conditioned; not the best prefixes of the greedy walk's per-slot distributions), and its
    acceptance is what decoding accepts there."""
    from types import SimpleNamespace

    from dflash_trainer.inference.acceptance import teacher_forced_blocks
    from dflash_trainer.inference.ddtree import accepted_per_budget, build_tree
    from dflash_trainer.loss.logits import transform_logits

    target = small_run["target"]
    drafter = load_drafter(small_run["tmp"] / "run" / "checkpoints" / "step-0000040", target)[0]
    # a strong Markov bias, so that a node's children really depend on its token (the 40-step drafter's
    # barely does, and the two kinds of tree would agree by chance)
    torch.manual_seed(0)
    drafter.markov_head.markov_w1.weight.data.normal_(0, 1.0)
    drafter.markov_head.markov_w2.weight.data.normal_(0, 0.3)  # bias ~ N(0, 1.2^2) per logit at rank 16
    span, budget = block_span(drafter.spec), 32
    decoder = SpeculativeDecoder(target, drafter, [0, 2])
    checked = walk_tree_differs = 0
    for row in small_run["rows"][:2]:
        prompt = row.input_ids[:40].tolist()
        res = decoder.generate(prompt, 40, mode="ddtree", budget=budget)
        ids = torch.tensor(prompt + res.tokens)
        packed = SimpleNamespace(input_ids=ids, position_ids=torch.arange(ids.numel()), loss_mask=torch.ones_like(ids))
        anchors = [a for a in res.anchors if a + span <= ids.numel()]
        context = target.features(ids, torch.arange(ids.numel()), need_teacher=False).context
        eval_accepted, trees = [], []
        for scored in teacher_forced_blocks(target, drafter, packed, torch.tensor(anchors)):
            draft_logits, greedy, tree_of = scored.draft_logits, scored.greedy, scored.tree_of
            log_probs = torch.log_softmax(transform_logits(draft_logits.float(), **drafter.spec.logit_options), -1)
            for j, path in enumerate(greedy.tolist()):
                tree = tree_of(j, budget)
                eval_accepted += accepted_per_budget(tree, path, [budget])
                walk_tree = build_tree(log_probs[j], budget)
                walk_tree_differs += (walk_tree.tokens, walk_tree.parents) != (tree.tokens, tree.parents)
                trees.append(tree)
        assert eval_accepted == res.accepted[: len(anchors)]
        for a, tree in zip(anchors, trees):
            cache = drafter.context_cache(context[:a], torch.arange(a))
            decoded = decoder._draft(int(ids[a]), a, cache)[2](budget)
            assert (decoded.tokens, decoded.parents) == (tree.tokens, tree.parents)
        checked += len(anchors)
    assert checked >= 8 and walk_tree_differs > 0  # the check tells the two kinds of tree apart
    print(f"{checked} blocks: eval's tree == decoding's; the greedy walk's prefix tree differs at {walk_tree_differs}")


def test_accepted_per_budget_is_the_smaller_budgets_tree():
    """One tree of the largest budget gives every smaller budget's acceptance (best-first prefixes)."""
    from dflash_trainer.inference.ddtree import accepted_in_tree, accepted_per_budget, build_tree

    g = torch.Generator().manual_seed(1)
    budgets = [1, 2, 5, 16, 40]
    for _ in range(20):
        lp = torch.log_softmax(torch.randn(6, 9, generator=g, dtype=torch.float64) * 2, -1)
        path = torch.randint(0, 3, (6,), generator=g).tolist()  # often inside the tree
        want = [accepted_in_tree(build_tree(lp, b), path) for b in budgets]
        assert accepted_per_budget(build_tree(lp, budgets[-1]), path, budgets) == want


def test_eval_reports_the_confidence_heads_calibration(small_run):
    """Eval's per-slot calibration: the confidence head's prediction along the walk beside the
    acceptance it is trained to predict, sum_v min(p_v, q_v), recomputed here for one block from the
    decoding path (the drafter's cache and walk, the target's own forward pass).

    Both paths run the networks in float64; the scorer and ``propose`` take the softmax of the logits in
    float32, as eval does. Bounds: the confidence, float64 throughout, within ``float64_forward_error``
    (two operation orders); the acceptance, sum_v min(p_v, q_v) with every p_v, q_v within relative eps
    of its exact value on each side (eps: the fp32 rounding of a logit, u |z|, relative in its exp, plus
    ``softmax_error`` over V; the exp of propose's log-softmax once more), so each side is within
    sum_v eps (p_v + q_v) = 2 eps of the exact sum and the two within 4 eps (2.0e-3 here; measured
    6e-8: worst cases are loose, a 1% error in either sum still exceeds it)."""
    import copy
    from types import SimpleNamespace

    from dflash_trainer.inference.acceptance import teacher_forced_blocks
    from dflash_trainer.loss.logits import transform_logits

    ckpt = small_run["tmp"] / "run" / "checkpoints" / "step-0000040"
    target = small_run["target"]
    drafter = load_drafter(ckpt, target)[0]
    report = acceptance_report(target, drafter, small_run["rows"][:2], budgets=[], max_blocks_per_row=8)
    c, d = report["confidence"], block_span(drafter.spec) - 1
    assert len(c["predicted"]) == len(c["measured"]) == d
    assert all(0 < x < 1 for x in c["predicted"] + c["measured"]) and c["abs_error"] >= 0
    target = TargetModel(copy.deepcopy(target.model).double(), layer_ids=target.layer_ids)
    drafter = load_drafter(ckpt, target)[0].double()
    ids = small_run["rows"][0].input_ids[:80]
    a = 30
    row = SimpleNamespace(input_ids=ids, position_ids=torch.arange(ids.numel()), loss_mask=torch.ones_like(ids))
    scored = next(teacher_forced_blocks(target, drafter, row, torch.tensor([a])))
    feats = target.features(ids[:a], torch.arange(a), need_teacher=False).context
    hidden = drafter.draft_block(int(ids[a]), a, drafter.context_cache(feats, torch.arange(a)))
    log_q, _ = variant_of(drafter.spec).propose(drafter, hidden, int(ids[a]))
    with torch.no_grad():  # the target's distribution of each draft's token: positions a .. a + D - 1
        logits = target.model(input_ids=ids[None, : a + d]).logits[0, a : a + d]
    p = torch.softmax(transform_logits(logits.float(), **drafter.spec.logit_options), -1)
    want = torch.minimum(p, log_q.exp()).sum(-1)
    z = torch.cat([transform_logits(logits, **drafter.spec.logit_options), log_q.double()])
    fp32 = torch.float32
    eps = tolerances.unit_roundoff(fp32) * z.abs().max().item() + tolerances.softmax_error(
        z.shape[-1], (z.max(-1).values[:, None] - z).max().item(), fp32
    )
    eps += tolerances.elementary_error(fp32)  # propose's q comes back through exp(log_softmax)
    assert (scored.acceptance[0].double() - want.double()).abs().max().item() <= 4 * eps
    walk_conf = variant_of(drafter.spec).walk(drafter, hidden[None], ids[a : a + 1])[2][0]
    bound = tolerances.float64_forward_error(len(drafter.layers) + target.model.config.num_hidden_layers, z.shape[-1])
    assert (scored.confidence[0] - walk_conf).abs().max().item() <= bound


def test_eval_walks_once_for_the_logits_and_the_confidence(small_run):
    """Eval takes a block group's draft logits and confidence from one Markov walk
    (``draft_logits_and_confidence``): the same bits as ``draft_logits`` and the walk's confidence."""
    from dflash_trainer.variants.base import Variant

    ckpt = small_run["tmp"] / "run" / "checkpoints" / "step-0000040"
    drafter = load_drafter(ckpt, small_run["target"])[0].eval()
    variant = variant_of(drafter.spec)
    assert type(variant).draft_logits_and_confidence is not Variant.draft_logits_and_confidence
    torch.manual_seed(0)
    hidden, anchors = torch.randn(5, drafter.spec.block_size, drafter.spec.hidden_size), torch.tensor([5, 9, 4, 7, 11])
    logits, confidence = variant.draft_logits_and_confidence(drafter, hidden, anchors, None)
    assert torch.equal(logits, variant.draft_logits(drafter, hidden, anchors, None))
    assert torch.equal(confidence, variant.walk(drafter, hidden, anchors)[2])


@pytest.mark.parametrize("from_anchor", [True, False])
def test_the_walks_one_head_gemm_is_the_per_slot_logits(small_run, from_anchor):
    """The walk takes every slot's head logits ``hidden[:, k] @ W^T`` from one GEMM and adds the Markov
    bias of the draft before (the anchor for the first): against the plain per-slot reference (the
    vanilla head's bias W2 W1[prev], one GEMV per block and slot) in float64, within the two
    evaluations' rounding, gamma_(H + r) of the magnitudes; and the DDTree's slot logits are the walk's."""
    import copy
    from dataclasses import replace

    from dflash_trainer.variants import make_drafter

    target = small_run["target"]
    target = TargetModel(copy.deepcopy(target.model).double(), layer_ids=target.layer_ids)
    trained = load_drafter(small_run["tmp"] / "run" / "checkpoints" / "step-0000040", target)[0]
    options = {**trained.spec.variant_options, "sample_from_anchor": from_anchor}
    drafter = make_drafter(replace(trained.spec, variant_options=options), target.embed_tokens, target.lm_head_weight)
    drafter.load_state_dict(trained.state_dict())
    drafter = drafter.double().eval()
    head, w = drafter.markov_head, drafter.lm_head_weight
    assert head.head_type == "vanilla"
    torch.nn.init.normal_(head.markov_w1.weight, std=0.5)  # a bias large enough to change drafts
    variant, first = variant_of(drafter.spec), 1 - int(from_anchor)
    g, b, h = 3, block_span(drafter.spec), drafter.spec.hidden_size
    hidden = torch.randn(g, b, h, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([5, 9, 4])
    logits, drafts, _ = variant.walk(drafter, hidden, anchors)
    assert logits.shape == (g, b - first, w.shape[0]) and drafts.shape == (g, b - first)
    for i in range(g):
        for j in range(b - first):
            prev = int(anchors[i]) if j == 0 else int(drafts[i, j - 1])
            bias_terms = head.markov_w2.weight * head.markov_w1.weight[prev]  # [V, r]
            want = hidden[i, first + j] @ w.T + bias_terms.sum(-1)
            magnitude = (hidden[i, first + j].abs() @ w.abs().T + bias_terms.abs().sum(-1)).max().item()
            bound = 2 * tolerances.gamma(h + head.rank, torch.float64) * magnitude  # both sides' rounding
            assert (logits[i, j] - want).abs().max().item() <= bound
            assert int(drafts[i, j]) == int(logits[i, j].argmax())
    root, _ = variant.tree_expansion(drafter, hidden[0], int(anchors[0]))
    assert int(root[0].argmax()) == int(drafts[0, 0])  # the tree's root children rank the walk's first draft first


def test_eval_command_on_a_dspark_checkpoint(small_run, tmp_path, capsys):
    """`dflash-train eval` end to end on a DSpark checkpoint: B draft slots in the report and the
    plots, and the calibration line under the table."""
    import json

    from dflash_trainer.cli import main

    ckpt = small_run["tmp"] / "run" / "checkpoints" / "step-0000040"
    out = tmp_path / "eval"
    code = main(
        ["eval", str(ckpt), "--data", str(small_run["data"]), "--out", str(out), "--budgets", "4,16"]
        + ["--max-blocks-per-row", "8", "--set", "data.seq_len=128"]
    )
    assert code == 0
    report = json.loads((out / "report.json").read_text())["checkpoints"][0]["report"]
    b = small_run["cfg"].drafter.block_size
    assert len(report["slot_acceptance"]) == len(report["confidence"]["predicted"]) == b
    assert (out / "acceptance_per_slot.png").stat().st_size > 0 and (out / "tau_vs_budget.png").stat().st_size > 0
    assert "confidence predicted/measured acceptance per slot" in capsys.readouterr().out
