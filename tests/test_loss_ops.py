"""The fused loss as torch.library custom ops: opcheck, torch.compile(fullgraph=True) of a drafter step,
meta and fake tensors, the memory tracker. The numbers themselves are test_loss.py's (float64)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_trainer.config import DrafterConfig
from dflash_trainer.data.blocks import build_blocks
from dflash_trainer.data.packing import doc_ids_from_positions
from dflash_trainer.loss import BlockCredit, LossTerms, PairTerm, fused, fused_draft_loss
from dflash_trainer.model.drafter import DFlashDrafter, DrafterSpec

F64 = torch.float64
TERMS = LossTerms(kl_weight=0.2, temperature=1.5, cap_weight=0.1)


def op_args(
    n=13, h=8, v=40, dtype=F64, want_grad=True, seed=0, terms=TERMS, policy="auto", bias_rows=None, bias_weight=None,
    block_ids=None,
):  # fmt: skip
    """The custom op's inputs: data of ``n`` rows in three slots, ``terms`` as their JSON, chunks of 5."""
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_(want_grad)
    ht = torch.randn(n, h, generator=g, dtype=dtype)
    head = torch.randn(v, h, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    weights = torch.rand(n, generator=g, dtype=dtype)
    weights[::4] = 0
    slots = torch.arange(n) % 3
    # the low-rank bias, block ids, the terms as JSON, chunk, policy, want_grad (after slot ids and their count)
    rest = (bias_rows, bias_weight, block_ids, terms.to_json(), 5, policy, want_grad)
    return (hs, ht, head, labels, weights, slots, 3, *rest)


@pytest.mark.parametrize("want_grad", [True, False])
def test_opcheck(want_grad):
    """torch.library's own checks: schema, fake implementation against the real one, autograd registration."""
    torch.library.opcheck(fused.fused_draft_loss_op, op_args(want_grad=want_grad))
    dh = torch.randn(6, 4, dtype=torch.float32)
    torch.library.opcheck(fused.fused_draft_loss_backward_op, (dh, torch.tensor(0.5), torch.bfloat16))


@pytest.mark.parametrize("policy", ["native", "false"])
@pytest.mark.parametrize("want_grad", [True, False])
def test_opcheck_with_dspark_terms(want_grad, policy):
    """The same checks with every DSpark input on (Markov bias, Renyi, acceptance, D-PARD): the native
    kernel computes the per-row terms in its row pass, the eager passes in theirs."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(15, 3, generator=g, dtype=F64).requires_grad_(want_grad)
    bias_weight = torch.randn(40, 3, generator=g, dtype=F64).requires_grad_(want_grad)
    block_ids = torch.arange(15) // 5
    pairs = (PairTerm("accept", "overlap"), PairTerm("renyi", "renyi_half", weight=0.4))
    terms = LossTerms(
        kl_weight=0.2, temperature=1.5, cap_weight=0.1, pair_terms=pairs, credit=BlockCredit("overlap", 0.5)
    )
    args = op_args(
        n=15, want_grad=want_grad, terms=terms, policy=policy, bias_rows=rows, bias_weight=bias_weight,
        block_ids=block_ids,
    )  # fmt: skip
    torch.library.opcheck(fused.fused_draft_loss_op, args)


def small_drafter():
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
    target = Qwen3ForCausalLM(cfg).double().eval()
    spec = DrafterSpec.from_target(
        target.config, DrafterConfig(num_layers=2, block_size=4), num_features=5, mask_token_id=3
    )
    drafter = DFlashDrafter(spec, target.get_input_embeddings(), target.get_output_embeddings().weight).double()
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3 if p.dim() > 1 else 1.0)
    return drafter


def step_inputs(drafter, length=20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (length,), generator=g)
    positions = torch.cat([torch.arange(12), torch.arange(length - 12)])
    loss_mask = torch.ones(length, dtype=torch.long)
    features = torch.randn(length, 5 * 16, generator=g, dtype=F64)
    anchors = torch.tensor([1, 5, 13])
    blocks = build_blocks(ids, positions, loss_mask, anchors, block_size=4, mask_token_id=3, gamma=4.0, num_blocks=4)
    masks = drafter.build_masks(blocks.anchors, blocks.doc_ids, doc_ids_from_positions(positions), "dense")
    teacher = torch.randn(16, 16, generator=g, dtype=F64)
    return blocks, features, positions, masks, teacher


def test_compiled_drafter_step_matches_eager():
    """Drafter forward and fused loss in one graph (fullgraph: a graph break is an error), compiled by
    AOTAutograd (the fake implementation traces the op, the registered backward joins the joint graph);
    its loss and every parameter gradient equal the eager step's in float64."""
    drafter = small_drafter()
    blocks, features, positions, masks, teacher = step_inputs(drafter)

    def step():
        hidden = drafter(blocks.input_ids, blocks.position_ids, features, positions, masks, "dense")
        loss, metrics = fused_draft_loss(
            hidden,
            teacher,
            drafter.lm_head_weight.detach(),
            blocks.labels.reshape(-1),
            blocks.weights.reshape(-1),
            TERMS,
            slot_ids=torch.arange(4).repeat(4),
            num_slots=4,
            chunk_size=5,
        )
        return loss, metrics["ce"], metrics["per_slot"]["accuracy"]

    def run(fn):
        drafter.zero_grad()
        loss, ce, acc = fn()
        loss.backward()
        return loss.detach(), ce, acc, [p.grad.clone() for p in drafter.parameters()]

    eager = run(step)
    torch._dynamo.reset()
    compiled = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    assert eager[0].item() > 0
    # aot_eager runs the traced ATen ops eagerly and the loss's custom ops as they are: the same kernels
    # in the same order, so the same floats
    for a, b in zip(eager[:3], compiled[:3]):
        assert torch.equal(a, b)
    for a, b in zip(eager[3], compiled[3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_and_fake_tensors_give_shapes_without_running_the_kernel(dtype):
    """On meta tensors the op is its fake implementation (the kernel would get data_ptr() == 0)."""
    n, h, v = 96, 32, 5000
    f = torch.float32
    for mode in (torch.device("meta"), FakeTensorMode()):
        with mode:
            hs = torch.empty(n, h, dtype=dtype, requires_grad=True)
            args = (torch.empty(n, h, dtype=dtype), torch.empty(v, h, dtype=dtype), torch.zeros(n, dtype=torch.long))
            loss, metrics = fused_draft_loss(
                hs, *args, torch.ones(n, dtype=dtype), TERMS, slot_ids=torch.zeros(n, dtype=torch.long), num_slots=6
            )
            loss.backward()
        assert loss.shape == () and loss.dtype == f
        assert metrics["per_slot"]["ce"].shape == (6,)
        assert hs.grad.shape == (n, h) and hs.grad.dtype == dtype
        assert isinstance(mode, torch.device) == (hs.grad.device.type == "meta")


def test_memory_tracker_follows_the_loss_on_meta_tensors():
    """MemTracker sees the op's outputs: dh [N, H] fp32 kept for the backward, then the gradient."""
    n, h, v = 1024, 256, 50_000
    with torch.device("meta"):
        hs = torch.empty(n, h, requires_grad=True)
        head, teacher = torch.empty(v, h), torch.empty(n, h)
        labels, weights = torch.zeros(n, dtype=torch.long), torch.ones(n)
    tracker = MemTracker()
    tracker.track_external(hs, head, teacher, labels, weights)
    with tracker:
        loss, _ = fused_draft_loss(hs, teacher, head, labels, weights, TERMS)
        after_forward = tracker.get_tracker_snapshot()[torch.device("meta")]["Total"]
        loss.backward()
    inputs = (2 * n * h + v * h + n) * 4 + n * 8  # hs, teacher, head, weights; int64 labels
    dh = n * h * 4
    # the forward leaves dh (the stats and scalars are bytes); the backward adds the gradient
    assert 0 <= after_forward - inputs - dh < 4096
    peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"]
    assert 0 <= peak - inputs - 3 * dh < 8192  # dh, grad_loss * dh, hs.grad (the accumulated copy)
