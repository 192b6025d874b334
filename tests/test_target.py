"""TargetModel: body only, hooked layers, early exit, packed rows; Qwen3, Qwen3.5 text and Llama."""

import pytest
import tolerances
import torch
from test_loss import OpRecorder
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dflash_trainer.errors import UserError
from dflash_trainer.model.target import TargetModel, default_layer_ids

V = 3000  # large against L so that an [L x V] tensor would stand out


def tiny(kind: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        cfg = Qwen3_5TextConfig(
            **common,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        )
        model = Qwen3_5ForCausalLM(cfg)
    return model.double().eval()


def test_default_layer_ids_rule():
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(8, 1) == [4]
    with pytest.raises(UserError, match="repeated layer ids"):
        default_layer_ids(6, 5)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_features_are_hooked_layer_outputs_and_final_norm(kind):
    model = tiny(kind)
    target = TargetModel(model)
    ids = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(1))
    feats = target.features(ids)
    assert target.layer_ids == [1, 2, 3, 4, 5]
    assert feats.context.shape == (20, 5 * 32) and feats.last_hidden.shape == (20, 32)
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i + 1][0] for i in target.layer_ids], dim=-1)  # id l = output of layer l
    # the hooks read the very forward transformers runs for hidden_states: equal bit for bit
    assert torch.equal(feats.context, expected)
    assert torch.equal(feats.last_hidden, hs[-1][0])  # final-normed


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_no_row_by_vocab_tensor_and_early_exit(kind):
    model = tiny(kind)
    target = TargetModel(model, layer_ids=[1, 3])
    calls = []
    model.model.layers[7].register_forward_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, V, (64,))
    with OpRecorder() as rec:
        target.features(ids, need_teacher=True)
    assert rec.largest < 64 * V, f"a tensor of {rec.largest} elements (L x V = {64 * V})"
    assert calls == [1]
    calls.clear()
    feats = target.features(ids, need_teacher=False)
    assert calls == [] and feats.last_hidden is None  # stopped after layer 3 of 8
    assert feats.context.shape == (64, 2 * 32)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_packed_row_equals_documents_alone(kind):
    target = TargetModel(tiny(kind))
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, V, (n,), generator=g) for n in (7, 12, 5)]
    row = torch.cat(docs)
    positions = torch.cat([torch.arange(d.numel()) for d in docs])
    packed = target.features(row, positions)
    alone = [target.features(d) for d in docs]
    # float64, the same network in two operation orders (attention over 24 keys or a document's):
    # tolerances.float64_forward_error of its layers, relative to the features' magnitude; a document
    # seeing another's keys or positions moves them by 1e-6 or more (the last check)
    cfg = target.model.config
    error = tolerances.float64_forward_error(layers=cfg.num_hidden_layers, inner=5 * cfg.hidden_size)
    for got, want in (
        (packed.context, [a.context for a in alone]),
        (packed.last_hidden, [a.last_hidden for a in alone]),
    ):
        want = torch.cat(want)
        assert torch.allclose(got, want, rtol=0, atol=error * want.abs().max().item())
    # and the packing really matters: without restarted positions the second document differs
    unpacked = target.features(row)
    assert not torch.allclose(unpacked.context[7:19], packed.context[7:19], atol=1e-6)


def test_bad_layer_ids():
    with pytest.raises(UserError, match=r"target layer ids \[8\] are out of range for a 8-layer target"):
        TargetModel(tiny("qwen3"), layer_ids=[1, 8])
