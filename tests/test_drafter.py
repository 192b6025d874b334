"""Drafter, anchors and masks: the batched training layout against one block at a time."""

import math
import warnings

import pytest
import tolerances
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_trainer.config import DrafterConfig
from dflash_trainer.data.blocks import build_blocks, sample_anchors, valid_anchor_positions
from dflash_trainer.data.packing import doc_ids_from_positions
from dflash_trainer.errors import UserError
from dflash_trainer.model.attention import MaskSpec, dense_mask
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec, resolve_mask_token_id

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
F64 = torch.float64


def make_drafter(target, *, num_layers=3, block_size=4, sliding=(), window=3, causal=False, k=5, dtype=F64):
    cfg = DrafterConfig(
        num_layers=num_layers,
        block_size=block_size,
        sliding_window_layers=list(sliding),
        sliding_window=window,
        causal_in_block_sliding=causal,
    )
    spec = DrafterSpec.from_target(target.config, cfg, num_features=k, mask_token_id=3)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, target.get_input_embeddings(), target.get_output_embeddings().weight).to(dtype)
    for p in drafter.parameters():  # random, not identity-like, so that masking mistakes show
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    return drafter.eval()


@pytest.fixture(scope="module")
def small_target():
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
    )
    return Qwen3ForCausalLM(cfg).double().eval()


def packed_row(lengths=(9, 14, 11), seed=0, k=5, hidden=16):
    g = torch.Generator().manual_seed(seed)
    length = sum(lengths)
    ids = torch.randint(4, 64, (length,), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    loss_mask = (torch.rand(length, generator=g) > 0.2).long()
    features = torch.randn(length, k * hidden, generator=g, dtype=F64)
    return ids, positions, loss_mask, features


def layout_bound(drafter, outputs: torch.Tensor, context_rows: int, extra_layers: int = 0) -> float:
    """How far two float64 evaluations of the drafter that differ only in operation order (the batched
    training layout, one block at a time, dense or flex attention) may lie apart: rounding alone,
    ``tolerances.float64_forward_error`` of its layers (``extra_layers``: a variant's more, DFlash2's
    convolution), the widest reduction the MLP's (5 H) or attention's over the context and the block,
    relative to the outputs' magnitude. A wrong mask, window or position moves them by 1e-3 or more."""
    spec = drafter.spec
    inner = max(5 * spec.hidden_size, context_rows + spec.block_size)
    error = tolerances.float64_forward_error(layers=spec.num_layers + extra_layers, inner=inner)
    return error * outputs.abs().max().item()


def per_block_reference(drafter, blocks, features, positions):
    """Every valid block on its own, with an explicit context slice (doc rows before the anchor)."""
    doc = doc_ids_from_positions(positions)
    outs = []
    for b in range(blocks.anchors.numel()):
        if not blocks.valid[b]:
            outs.append(None)
            continue
        a = int(blocks.anchors[b])
        rows = ((doc == doc[a]) & (torch.arange(len(doc)) < a)).nonzero().squeeze(1)
        cache = drafter.context_cache(features[rows], positions[rows])
        outs.append(drafter.draft_block(int(blocks.input_ids[b, 0]), int(positions[a]), cache))
    return outs


@pytest.mark.parametrize("variant", ["full", "sliding", "sliding_causal"])
def test_training_layout_matches_per_block_reference_and_flex(small_target, variant):
    sliding = () if variant == "full" else (0, 2)
    drafter = make_drafter(small_target, sliding=sliding, causal=variant == "sliding_causal")
    ids, positions, loss_mask, features = packed_row()
    doc = doc_ids_from_positions(positions)
    anchors = sample_anchors(loss_mask, doc, 4, 6, torch.Generator().manual_seed(3))
    blocks = build_blocks(
        ids, positions, loss_mask, anchors, block_size=4, mask_token_id=3, gamma=4.0, num_blocks=anchors.numel() + 2
    )  # two padding blocks
    assert anchors.numel() == 6
    with torch.no_grad():  # FlexAttention has no backward on CPU
        dense = drafter(
            blocks.input_ids,
            blocks.position_ids,
            features,
            positions,
            drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense"),
            "dense",
        )
        flex = drafter(
            blocks.input_ids,
            blocks.position_ids,
            features,
            positions,
            drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "flex"),
            "flex",
        )
    dense, flex = dense.view(-1, 4, 16), flex.view(-1, 4, 16)
    ref = per_block_reference(drafter, blocks, features, positions)
    bound = layout_bound(drafter, dense[blocks.valid], positions.numel())
    for b, r in enumerate(ref):
        if r is not None:
            assert torch.allclose(dense[b], r, rtol=0, atol=bound), f"block {b}"
    assert torch.allclose(dense[blocks.valid], flex[blocks.valid], rtol=0, atol=bound)
    assert torch.isfinite(dense).all()  # padding blocks see their own keys: no NaN


def test_sliding_window_really_limits_context(small_target):
    ids, positions, loss_mask, features = packed_row(lengths=(30,))
    doc = doc_ids_from_positions(positions)
    anchors = torch.tensor([20])
    blocks = build_blocks(ids, positions, loss_mask | 1, anchors, block_size=4, mask_token_id=3, gamma=4.0)
    outs = {}
    for sliding in ((), (0, 1, 2)):
        d = make_drafter(small_target, sliding=sliding, window=3)
        outs[sliding] = d(
            blocks.input_ids,
            blocks.position_ids,
            features,
            positions,
            d.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense"),
        )
        changed = features.clone()
        changed[5] += 10.0  # a row far outside the window of 3 before anchor 20
        again = d(
            blocks.input_ids,
            blocks.position_ids,
            changed,
            positions,
            d.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense"),
        )
        assert torch.equal(again, outs[sliding]) == bool(sliding)


def test_dense_mask_rule():
    anchors, block_doc = torch.tensor([3, 6]), torch.tensor([0, 1])
    context_doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    m = dense_mask(anchors, block_doc, context_doc, 2, MaskSpec(window=1, causal_in_block=True))
    assert m.shape == (4, 12)
    assert m[0, :8].nonzero().squeeze(1).tolist() == [2]  # block 0: row 2 only (c < 3, c >= 3-1)
    assert m[2, :8].nonzero().squeeze(1).tolist() == [5]  # block 1, doc 1: row 5
    assert m[1, 8:].tolist() == [True, True, False, False] and m[0, 8:].tolist() == [True, False, False, False]
    assert m[3, 8:].tolist() == [False, False, True, True]


def test_train_serve_parity_on_a_real_tiny_target_row():
    from dflash_trainer.model.target import TargetModel
    from dflash_trainer.tiny_target import load_tiny_target
    from dflash_trainer.tiny_target.corpus import load_split

    model, tok = load_tiny_target()
    target = TargetModel(model.double())  # float64: the two paths' rounding is far below any real difference
    text = load_split("held_out", limit=1)[0].text
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][:160])
    positions = torch.arange(ids.numel())
    feats = target.features(ids, positions, need_teacher=False)
    cfg = DrafterConfig(num_layers=2, block_size=8, sliding_window_layers=[0], sliding_window=32)
    spec = DrafterSpec.from_target(model.config, cfg, num_features=5, mask_token_id=tok.mask_token_id)
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight).double().eval()
    anchors = torch.tensor([5, 40, 77, 120, 151])
    blocks = build_blocks(
        ids, positions, torch.ones_like(ids), anchors, block_size=8, mask_token_id=spec.mask_token_id, gamma=4.0
    )
    doc = doc_ids_from_positions(positions)
    with torch.no_grad():
        train_h = drafter(
            blocks.input_ids,
            blocks.position_ids,
            feats.context,
            positions,
            drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense"),
        ).view(5, 8, -1)
    for b, a in enumerate(anchors.tolist()):
        cache = drafter.context_cache(feats.context[:a], positions[:a])  # as a server caches the prefix
        serve_h = drafter.draft_block(int(ids[a]), a, cache)
        train_logits, serve_logits = drafter.block_logits(train_h[b]), drafter.block_logits(serve_h)
        # The same network over the same inputs, computed in another order (one masked pass over all
        # blocks vs a cached prefix and one block): in float64 they differ by rounding alone, a few
        # gamma_K (K <= the widest inner dimension, 5 x H) per layer on logits of magnitude |z|:
        # ``float64_forward_error`` (tests/tolerances.py). A wrong mask or position moves logits by >1e-3.
        bound = tolerances.float64_forward_error(layers=spec.num_layers + 1, inner=5 * spec.hidden_size)
        assert torch.allclose(train_logits, serve_logits, atol=bound * train_logits.abs().max().item(), rtol=0), a
        assert torch.equal(train_logits.argmax(-1), serve_logits.argmax(-1))


def test_document_boundaries_follow_position_jumps():
    # HF keeps packed documents apart wherever positions do not continue; so do anchors and masks
    assert doc_ids_from_positions(torch.tensor([0, 1, 2, 0, 1, 5, 6])).tolist() == [0, 0, 0, 1, 1, 2, 2]


def test_anchors_and_blocks():
    positions = torch.cat([torch.arange(6), torch.arange(10)])
    doc = doc_ids_from_positions(positions)
    loss_mask = torch.ones(16, dtype=torch.long)
    loss_mask[8] = 0
    valid = valid_anchor_positions(loss_mask, doc, 4)
    assert valid.tolist() == [0, 1, 2, 6, 7, 9, 10, 11, 12]  # blocks stay inside a document, anchor has loss
    g = torch.Generator().manual_seed(0)
    first, second = sample_anchors(loss_mask, doc, 4, 4, g), sample_anchors(loss_mask, doc, 4, 4, g)
    assert first.tolist() == sorted(first.tolist()) and len(set(first.tolist())) == 4
    assert not torch.equal(first, second)  # fresh every step
    assert torch.equal(first, sample_anchors(loss_mask, doc, 4, 4, torch.Generator().manual_seed(0)))  # seeded
    ids = torch.arange(100, 116)
    blocks = build_blocks(
        ids, positions, loss_mask, torch.tensor([6]), block_size=4, mask_token_id=3, gamma=4.0, num_blocks=3
    )
    assert blocks.input_ids[0].tolist() == [106, 3, 3, 3]
    assert blocks.position_ids[0].tolist() == [0, 1, 2, 3]
    assert blocks.labels[0].tolist() == [0, 107, 0, 109]  # slot 0 and the loss_mask-0 slot carry no label
    w = blocks.weights[0]
    # exp(-(3 - 1) / 4) in the weights' dtype and in float64: the exponent's rounding and exp's, a few units
    u = tolerances.unit_roundoff(w.dtype)
    assert w[0] == 0 and w[2] == 0 and w[1] == 1
    assert abs(w[3].item() - math.exp(-0.5)) <= 2 * u + tolerances.elementary_error(w.dtype)
    assert blocks.teacher_index[0].tolist() == [5, 6, 7, 8]  # hidden at anchor + k - 1 predicts slot k
    assert blocks.weights[1:].sum() == 0 and not blocks.valid[1:].any()  # padding blocks
    assert sample_anchors(torch.zeros(16, dtype=torch.long), doc, 4, 4, g).numel() == 0


def test_noise_only_in_training(small_target):
    drafter = make_drafter(small_target)
    drafter.spec = DrafterSpec(**{**drafter.spec.__dict__, "noise": "uniform", "noise_scale": 0.5})
    feats = torch.randn(5, 80, dtype=F64)
    assert torch.equal(drafter.eval().context(feats), drafter.context(feats))
    assert not torch.equal(drafter.train().context(feats), drafter.eval().context(feats))


def test_drafter_shares_target_head_and_embedding(small_target):
    drafter = make_drafter(small_target)
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_proj.weight"} <= names
    assert drafter.lm_head_weight.data_ptr() == small_target.get_output_embeddings().weight.data_ptr()


def test_block_logits_take_the_strided_draft_slots_of_several_blocks(small_target):
    """Eval hands ``block_logits`` the draft slots of g blocks, a strided ``[g, D, H]`` view, and it runs
    them as one flattened GEMM: every slot's logits are its own row times the head, in place. Against
    the product row by row, each within gamma_H of sum |h| |w| (H products summed in float64)."""
    drafter = make_drafter(small_target)
    hidden = torch.randn(5, 4, 16, dtype=F64)
    slots = hidden[:, 1:]  # [5, 3, 16], not contiguous
    got = drafter.block_logits(slots)
    w = drafter.lm_head_weight
    want = torch.stack([torch.stack([w @ slots[i, j] for j in range(3)]) for i in range(5)])
    bound = tolerances.gamma(16, F64) * torch.stack(
        [torch.stack([w.abs() @ slots[i, j].abs() for j in range(3)]) for i in range(5)]
    )
    assert got.shape == (5, 3, 64) and not slots.is_contiguous()
    assert ((got - want).abs() <= 2 * bound).all()  # 2: both sides round


def test_bad_input_errors(small_target):
    class NoMask:
        mask_token_id = None
        unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return None

    with pytest.raises(UserError, match="no mask token"):
        resolve_mask_token_id(NoMask(), None, 64)
    with pytest.raises(
        UserError, match="mask token id 99 from drafter.mask_token_id is outside the target vocabulary 0..63"
    ):
        resolve_mask_token_id(None, 99, 64)
    drafter = make_drafter(small_target)
    with pytest.raises(
        UserError, match="context features have width 48, the drafter expects 5 layers x hidden 16 = 80"
    ):
        drafter.context(torch.zeros(3, 48, dtype=F64))
    spec = DrafterSpec(
        hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=32, vocab_size=64, block_size=1
    )
    with pytest.raises(UserError, match="block_size must be >= 2, got 1"):
        DFlashDrafter(spec, small_target.get_input_embeddings(), small_target.get_output_embeddings().weight)
    wrong_hidden = DrafterSpec(**{**spec.__dict__, "block_size": 4, "hidden_size": 32})
    with pytest.raises(UserError, match=r"target embedding is \(64, 16\), drafter expects \[vocab 64, hidden 32\]"):
        DFlashDrafter(wrong_hidden, small_target.get_input_embeddings(), small_target.get_output_embeddings().weight)
