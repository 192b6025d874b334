"""DFlash2 on the shared backbone (variants/dflash2/): the local convolutions (identity at init, no
leak across blocks in either attention backend, training layout == serving layout), the selector
walk at inference against a plain per-slot reference, and the DDTree over the selector's scores."""

import dataclasses
import warnings

import pytest
import test_drafter
import tolerances
import torch
from test_drafter import packed_row, per_block_reference

from dflash_trainer.config import DrafterConfig
from dflash_trainer.data.blocks import build_blocks, sample_anchors
from dflash_trainer.data.packing import doc_ids_from_positions
from dflash_trainer.errors import UserError
from dflash_trainer.inference.ddtree import draft_tree
from dflash_trainer.loss import LossTerms
from dflash_trainer.loss.logits import transform_logits
from dflash_trainer.model.drafter import DrafterSpec
from dflash_trainer.variants import make_drafter, variant_of
from dflash_trainer.variants.dflash2.modules import grouped_dynamic_conv
from dflash_trainer.variants.dflash2.objective import selector_training_candidates

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
F64 = torch.float64
B = 4
small_target = test_drafter.small_target  # the module-scoped fixture of test_drafter.py


def dflash2_drafter(target, *, variant="dflash2", kernel=2, group=4, top_k=5, sliding=(), randomize=True, seed=0):
    cfg = DrafterConfig(num_layers=3, block_size=B, sliding_window_layers=list(sliding), sliding_window=3)
    cfg.variant = variant
    if variant == "dflash2":
        cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size = kernel, group
        cfg.dflash2.selector_rank, cfg.dflash2.selector_top_k = 6, top_k
    spec = DrafterSpec.from_target(target.config, cfg, num_features=5, mask_token_id=3)
    torch.manual_seed(seed)
    drafter = make_drafter(spec, target.get_input_embeddings(), target.get_output_embeddings().weight).to(F64)
    if randomize:  # random, not identity-like, so that a leak or a wrong tap shows
        for p in drafter.parameters():
            torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    return drafter.eval()


def training_layout(drafter, blocks, features, positions, backend="dense"):
    doc = doc_ids_from_positions(positions)
    with torch.no_grad():
        masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, backend)
        return drafter(blocks.input_ids, blocks.position_ids, features, positions, masks, backend).view(-1, B, 16)


def some_blocks(n=6, seed=3):
    ids, positions, loss_mask, features = packed_row()
    doc = doc_ids_from_positions(positions)
    anchors = sample_anchors(loss_mask, doc, B, n, torch.Generator().manual_seed(seed))
    blocks = build_blocks(ids, positions, loss_mask, anchors, block_size=B, mask_token_id=3, gamma=4.0)
    return blocks, features, positions


def plain_conv(x, dynamic, base, block):
    """The convolution element by element: out[j, c] = sum_t x[j-t, c] (base[t, c] + dynamic[j, t, c // g])."""
    t_rows, hidden = x.shape
    g = hidden // dynamic.shape[-1]
    out = torch.zeros_like(x)
    for j in range(t_rows):
        for t in range(base.shape[0]):
            if j % block >= t:
                for c in range(hidden):
                    out[j, c] += x[j - t, c] * (base[t, c] + dynamic[j, t, c // g])
    return out


@pytest.mark.parametrize("kernel", [1, 2, 3])
def test_grouped_dynamic_conv_matches_the_plain_formula(kernel):
    g = torch.Generator().manual_seed(kernel)
    x = torch.randn(3 * B, 8, generator=g, dtype=F64)
    dyn = torch.randn(3 * B, kernel, 2, generator=g, dtype=F64)
    base = torch.randn(kernel, 8, generator=g, dtype=F64)
    # each output a sum of ``kernel`` products x (base + dynamic), in either order: gamma_(2 kernel + 1) of
    # the sum of their absolute values (the formula on absolute values), on each side
    bound = 2 * tolerances.gamma(2 * kernel + 1, F64) * plain_conv(x.abs(), dyn.abs(), base.abs(), B)
    assert ((grouped_dynamic_conv(x, dyn, base, B) - plain_conv(x, dyn, base, B)).abs() <= bound).all()


def test_an_untrained_dflash2_computes_exactly_dflash(small_target):
    """Identity base kernel and a zero projection: bit-identical hidden states to the DFlash drafter
    with the same backbone weights."""
    dflash = dflash2_drafter(small_target, variant="dflash")
    dflash2 = dflash2_drafter(small_target, randomize=False)
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in m or "candidate_selector" in m for m in missing)
    blocks, features, positions = some_blocks()
    assert torch.equal(
        training_layout(dflash, blocks, features, positions), training_layout(dflash2, blocks, features, positions)
    )
    assert len([n for n in dflash2.state_dict() if "conv" in n]) == 3 * 2 * 2  # 3 layers x 2 convs x 2 tensors


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_convolutions_never_cross_a_block_boundary(small_target, backend):
    """Changing block b's tokens leaves block b+1 (adjacent in the flattened layout) bit-identical; the
    blocks' outputs also equal one block at a time in the serving layout."""
    drafter = dflash2_drafter(small_target, kernel=3)
    blocks, features, positions = some_blocks()
    before = training_layout(drafter, blocks, features, positions, backend)
    for b in range(blocks.anchors.numel() - 1):
        changed = blocks.input_ids.clone()
        changed[b] = torch.randint(4, 64, (B,), generator=torch.Generator().manual_seed(b))
        changed[b, 0] = (changed[b, 0] + 1) % 60 + 4  # the anchor too: every slot of block b differs
        after = training_layout(drafter, dataclasses.replace(blocks, input_ids=changed), features, positions, backend)
        assert not torch.equal(after[b], before[b])
        keep = [i for i in range(blocks.anchors.numel()) if i != b]
        assert torch.equal(after[keep], before[keep]), f"block {b}'s tokens reached another block"
    # float64 in two operation orders: test_drafter.layout_bound, the convolution one layer more
    bound = test_drafter.layout_bound(drafter, before[blocks.valid], positions.numel(), extra_layers=1)
    for b, ref in enumerate(per_block_reference(drafter, blocks, features, positions)):
        if ref is not None:
            assert torch.allclose(before[b], ref, rtol=0, atol=bound), f"block {b}"


def test_a_leaking_convolution_would_be_caught():
    """The flattened shift (no block view) reaches the previous block: the formula's block rule matters."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * B, 8, generator=g, dtype=F64)
    dyn, base = torch.randn(2 * B, 2, 2, generator=g, dtype=F64), torch.randn(2, 8, generator=g, dtype=F64)
    leaky = x * (base[0] + dyn[:, 0].repeat_interleave(4, -1))
    leaky[1:] += x[:-1] * (base[1] + dyn[1:, 1].repeat_interleave(4, -1))
    ours = grouped_dynamic_conv(x, dyn, base, B)
    assert torch.allclose(ours[1:B], leaky[1:B]) and not torch.allclose(ours[B], leaky[B])


def plain_walk(drafter, hidden, anchor):
    """The selector walk slot by slot from the module's parameters, in float64."""
    sel = drafter.candidate_selector
    unary = transform_logits(hidden[1:] @ drafter.lm_head_weight.T, **drafter.spec.logit_options)
    prev, drafts, scores = anchor, [], []
    for k in range(B - 1):
        top, cand = unary[k].topk(sel.top_k)
        ctx = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hidden[1 + k])
        s = top + sel.successor_codebook[cand] @ ctx
        prev = int(cand[s.argmax()])
        drafts.append(prev)
        scores.append((cand, s))
    return drafts, scores


@torch.no_grad()
def test_propose_is_the_selector_walk(small_target):
    drafter = dflash2_drafter(small_target)
    variant = variant_of(drafter.spec)
    hidden = torch.randn(B, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    log_probs, drafts = variant.propose(drafter, hidden, 7)
    want, scores = plain_walk(drafter, hidden, 7)
    assert drafts == want
    for k, (cand, s) in enumerate(scores):
        assert torch.isinf(log_probs[k]).sum() == 64 - drafter.candidate_selector.top_k  # zero outside the K
        # two float64 log-softmaxes: tolerances.log_softmax_error on each side
        exact = torch.log_softmax(s, -1)
        bound = 2 * tolerances.log_softmax_error(s.numel(), (s.max() - s.min()).item(), exact, F64)
        assert ((log_probs[k][cand] - exact).abs() <= bound).all()
    # teacher-forced eval reads the same drafts
    logits = variant.draft_logits(drafter, hidden[None], torch.tensor([7]), None)
    assert logits[0].argmax(-1).tolist() == want
    # candidate recall: a token is a hit exactly when it is among its slot's K unary candidates
    for token in range(64):
        hits = variant.candidate_hits(drafter, logits, torch.full((1, B - 1), token))[0].tolist()
        assert hits == [token in cand.tolist() for cand, _ in scores]
    # the walk is not the unary argmax here (the selector matters), else the test would prove little
    unary = hidden[1:] @ drafter.lm_head_weight.T
    assert unary.argmax(-1).tolist() != want


@torch.no_grad()
def test_ddtree_follows_the_selector_given_each_nodes_token(small_target):
    drafter = dflash2_drafter(small_target)
    variant = variant_of(drafter.spec)
    hidden = torch.randn(B, 16, dtype=F64, generator=torch.Generator().manual_seed(2))
    tree = draft_tree(variant, drafter, hidden, 7, None, 12, B - 1)
    assert len(tree) == 12
    sel = drafter.candidate_selector
    unary = hidden[1:] @ drafter.lm_head_weight.T
    # a node's log-probability is its parent's plus its own: the own term within
    # tolerances.log_softmax_error on each side, the addition one rounding on each side
    u = tolerances.unit_roundoff(F64)
    for i, (tok, depth, parent) in enumerate(zip(tree.tokens, tree.depths, tree.parents)):
        prev = 7 if parent < 0 else tree.tokens[parent]
        top, cand = unary[depth - 1].topk(sel.top_k)
        ctx = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hidden[depth])
        scores = top + sel.successor_codebook[cand] @ ctx
        lp = torch.log_softmax(scores, -1)
        assert tok in cand.tolist(), "a node outside its slot's K candidates"
        own = lp[cand.tolist().index(tok)]
        parent_lp = 0.0 if parent < 0 else tree.logprobs[parent]
        spread = (scores.max() - scores.min()).item()
        own_apart = 2 * tolerances.log_softmax_error(sel.top_k, spread, float(own), F64)
        assert abs(tree.logprobs[i] - (parent_lp + float(own))) <= own_apart + 2 * u * abs(tree.logprobs[i])
    # the greedy walk is the tree's first path
    drafts = variant.propose(drafter, hidden, 7)[1]
    node, path = -1, []
    for tok in drafts:
        node = tree.children().get((node, tok))
        if node is None:
            break
        path.append(tok)
    assert path == drafts[: len(path)] and len(path) >= 1


def test_selector_training_candidates():
    ids = torch.tensor([[5, 3, 9], [5, 3, 9], [1, 2, 4]])
    labels = torch.tensor([3, 7, 4])
    cand, pos, inside = selector_training_candidates(ids, labels)
    assert cand.tolist() == [[5, 3, 9], [5, 3, 7], [1, 2, 4]]
    assert pos.tolist() == [1, 2, 2] and inside.tolist() == [True, False, True]


def test_bad_settings_are_one_line_errors(small_target):
    with pytest.raises(UserError, match="conv_group_size 5 must divide the hidden size 16"):
        dflash2_drafter(small_target, group=5)
    with pytest.raises(UserError, match="conv_kernel_size 5 exceeds the block size 4"):
        dflash2_drafter(small_target, kernel=5)
    with pytest.raises(UserError, match="selector_top_k 65 exceeds the vocabulary"):
        dflash2_drafter(small_target, top_k=65)


@pytest.mark.parametrize("kernel", [1, 2, 3])
def test_the_lean_convolution_equals_autograd_through_the_formula(kernel):
    """``_LeanConv`` (inputs saved, taps recomputed in backward) against autograd of the plain formula."""
    from dflash_trainer.variants.dflash2.modules import _LeanConv

    g = torch.Generator().manual_seed(kernel)
    x = torch.randn(3 * B, 8, generator=g, dtype=F64, requires_grad=True)
    dyn = torch.randn(3 * B, kernel, 2, generator=g, dtype=F64, requires_grad=True)
    base = torch.randn(kernel, 8, generator=g, dtype=F64, requires_grad=True)
    grad = torch.randn(3 * B, 8, generator=g, dtype=F64)
    want = torch.autograd.grad(grouped_dynamic_conv(x, dyn, base, B), (x, dyn, base), grad)
    out = _LeanConv.apply(x, dyn, base, B)
    assert torch.equal(out, grouped_dynamic_conv(x, dyn, base, B))
    got = torch.autograd.grad(out, (x, dyn, base), grad)
    # every gradient element a sum of products (over taps, a group's channels or the 3 B rows): gamma of
    # the longest sum times the sum of the terms' absolute values (the same gradient of the absolute
    # values), on each side
    absolute = [t.detach().abs().requires_grad_() for t in (x, dyn, base)]
    magnitudes = torch.autograd.grad(grouped_dynamic_conv(*absolute, B), absolute, grad.abs())
    for w, h, m in zip(want, got, magnitudes):
        assert ((w - h).abs() <= 2 * tolerances.gamma(3 * B + 2, F64) * m).all()
    assert torch.autograd.gradcheck(lambda *a: _LeanConv.apply(*a, B), (x, dyn, base))


def plain_dflash2_loss(drafter, hidden, head, labels, weights, prev, k, alpha, terms):
    """The whole DFlash2 objective from full logits, written out: the reference DFlash loss plus alpha x
    the weighted K-way cross-entropy over the top K (the label replacing the weakest when outside)."""
    from dflash_trainer.loss import reference_draft_loss

    base, _ = reference_draft_loss(hidden, None, head, labels, weights, terms)
    z = transform_logits(hidden @ head.T, logit_scale=terms.logit_scale, softcap=terms.softcap)
    sel = drafter.candidate_selector
    total, wsum = 0.0, 0.0
    for i in range(hidden.shape[0]):
        if weights[i] == 0:
            continue
        cand = z[i].detach().topk(k).indices.tolist()
        if int(labels[i]) not in cand:
            cand[-1] = int(labels[i])
        ctx = sel.predecessor_codebook[prev[i]] * (sel.hidden_projection.weight @ hidden[i])
        scores = torch.stack([z[i, c] + sel.successor_codebook[c] @ ctx for c in cand])
        total = total + weights[i] * (torch.logsumexp(scores, 0) - scores[cand.index(int(labels[i]))])
        wsum = wsum + weights[i]
    return base + alpha * total / wsum


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_dflash2_loss_and_its_gradients_match_the_plain_objective(small_target, reference, softcap):
    """float64: the fused path (top K from the chunk loop, candidate logits recomputed per row) and the
    reference path against the objective written out above, loss and every gradient."""
    from types import SimpleNamespace

    drafter = dflash2_drafter(small_target, top_k=5)
    variant = variant_of(drafter.spec)
    g = torch.Generator().manual_seed(4)
    n = 5 * B
    hidden = torch.randn(n, 16, generator=g, dtype=F64, requires_grad=True)
    head = drafter.lm_head_weight.detach()
    labels = torch.randint(0, 64, (n,), generator=g)
    take = torch.rand(n, generator=g) < 0.6  # most labels among the top K, some not
    labels[take] = (hidden.detach() @ head.T).topk(3, -1).indices[take, 1]
    weights = torch.rand(n, generator=g, dtype=F64) + 0.2
    weights[::B] = 0.0
    prev = torch.randint(0, 64, (n,), generator=g)
    batch = SimpleNamespace(weights=weights, labels=labels, slots=torch.arange(n) % B, extras={"prev_ids": prev})
    terms = LossTerms(kl_weight=0.0, cap_weight=0.2, label_source="data", logit_scale=0.9, softcap=softcap)
    loss, metrics = variant.loss(drafter, hidden, None, head, batch, terms, {"chunk_size": 7}, reference=reference)
    alpha = drafter.spec.variant_options["selector_alpha"]
    terms_ref = LossTerms(cap_weight=0.2, logit_scale=0.9, softcap=softcap)
    want = plain_dflash2_loss(drafter, hidden, head, labels, weights, prev, 5, alpha, terms_ref)
    params = [hidden, *drafter.candidate_selector.parameters()]
    got_g = torch.autograd.grad(loss, params, retain_graph=True)
    want_g = torch.autograd.grad(want, params)
    # float64, one objective in two operation orders (the head's GEMM and softmax over V, the selector's
    # scores): tolerances.float64_forward_error of those two stages, relative to each result's magnitude
    rel = tolerances.float64_forward_error(layers=2, inner=head.shape[0])
    assert abs(loss.item() - want.item()) <= rel * abs(want.item())
    for a, b in zip(got_g, want_g):
        assert torch.allclose(a, b, rtol=0, atol=rel * b.abs().max().item())
    assert 0 < metrics["candidate_recall"] < 1 and 0 <= metrics["selector_accuracy"] <= 1


def test_training_step_matches_the_reference_loss(tmp_path):
    """One real step (tiny target, bf16 loss off: fp32) through draft_loss, fused against reference."""
    from test_train import SMALL, fused_and_reference_in_float64, write_data

    from dflash_trainer.config import load_config
    from dflash_trainer.training.setup import prepare
    from dflash_trainer.training.trainer import Trainer

    data = write_data(tmp_path / "data.jsonl", n=4)
    cfg = load_config(
        ["tiny-demo"],
        [
            *SMALL,
            f"data.train_files=[{data}]",
            f"output_dir={tmp_path / 'run'}",
            "drafter.variant=dflash2",
            "drafter.dflash2.selector_rank=16",
            "loss.kl_weight=0.2",
            "train.dtype=float32",
        ],
    )
    target, tok, rows, _, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, rows, out_dir=tmp_path / "run", target_path="tiny", progress=False)
    d = trainer.drafter
    for conv in (d.layers[0].attention_conv, d.layers[0].mlp_conv):  # away from the identity
        torch.nn.init.normal_(conv.kernel_projection.weight, std=0.05)
    params = [
        d.fc.weight,
        d.layers[0].attention_conv.kernel_projection.weight,
        d.layers[0].mlp_conv.base_kernel,
        *d.candidate_selector.parameters(),
    ]
    metrics = fused_and_reference_in_float64(target, d, rows[0], cfg, params)
    assert metrics["selector_ce"] > 0  # the successor codebook learns: its gradient is nonzero (checked there)
