"""The target families users train for, each a tiny random model (tests/families.py): speculative
decoding is token-for-token plain greedy in chain and DDTree modes (past the sliding window, and with
recurrent state on hybrids), and packed rows give per-document features."""

from __future__ import annotations

import copy

import pytest
import tolerances
import torch
from families import FAMILIES, HYBRID, MOE, SLIDING, WINDOW, build_family

from dflash_trainer.inference.ddtree import build_tree
from dflash_trainer.inference.speculative import SpeculativeDecoder, _forward_cache_kwarg, target_greedy
from dflash_trainer.model.target import TargetModel

PROMPT = list(range(100, 110))
NEW_TOKENS = 40  # prompt + output = 50 tokens, twice the sliding window
HYBRID_TOKENS = 20  # no window to pass; the torch fallback of Gated DeltaNet is slow on a CPU
BLOCK = 6


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            model = build_family(name)
            cache[name] = (model, target_greedy(model, PROMPT, NEW_TOKENS, [0])[0])
        return cache[name]

    return get


class OracleDrafts(SpeculativeDecoder):
    """The target side of ``SpeculativeDecoder`` unchanged; the drafts come from the reference greedy
    continuation, with about a third of the slots corrupted (a wrong token ranked first, the right one
    second), so rounds accept partly, fully, and off the top-1 branch of a tree."""

    def __init__(self, target: TargetModel, reference: list[int], seed: int = 0):
        self.target, self.model, self.eos = target, target.model, {0}
        self._cache_kwarg = _forward_cache_kwarg(self.model)
        self.target_tokens = 0
        self.reference, self.gen = reference, torch.Generator().manual_seed(seed)

    def _extend_context(self, drafter_cache, feats, start):
        return None

    def _draft(self, anchor, anchor_pos, drafter_cache):
        log_probs = self._oracle_log_probs(anchor_pos)
        return log_probs, log_probs.argmax(-1).tolist(), lambda budget: build_tree(log_probs, budget)

    def _oracle_log_probs(self, anchor_pos):
        vocab = self.target.vocab_size
        logits = torch.randn(BLOCK - 1, vocab, generator=self.gen)
        for j in range(BLOCK - 1):
            i = anchor_pos + 1 + j
            if i < len(self.reference):
                logits[j, self.reference[i]] = 10.0
                if torch.rand(1, generator=self.gen) < 0.3:
                    logits[j, int(torch.randint(vocab, (1,), generator=self.gen))] = 11.0
        return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("mode, budget", [("chain", 1), ("ddtree", 10)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculative_equals_greedy(models, family, mode, budget):
    model, greedy = models(family)
    assert len(set(greedy)) > NEW_TOKENS // 2, "degenerate target: greedy repeats itself"
    if family in HYBRID:
        greedy = greedy[:HYBRID_TOKENS]
    decoder = OracleDrafts(TargetModel(model, layer_ids=[1, 2]), PROMPT + greedy)
    result = decoder.generate(PROMPT, len(greedy), mode, budget=budget)
    assert result.tokens == greedy
    assert max(result.accepted) == BLOCK - 1 and min(result.accepted) < BLOCK - 1  # full and partial rounds
    # decoding from one prefill twice: each run works on its own copy of the prompt's cache
    prefilled = decoder.prefill(PROMPT)
    for _ in range(2):
        assert decoder.generate(PROMPT, len(greedy), mode, budget=budget, prefilled=prefilled).tokens == greedy
    if family in SLIDING:
        assert len(PROMPT) + NEW_TOKENS > 2 * WINDOW


def test_hybrid_tree_needs_per_path_verification(models):
    """Why hybrids verify per path: with one ancestor-masked pass, a node's logits are not those of its
    path run alone (the recurrence mixes branches); per path they are."""
    model, _ = models("qwen3_5")
    model = copy.deepcopy(model).double()  # float64: the masked pass and the path alone differ by rounding only
    prompt = PROMPT
    path_a, path_b = [7, 8, 9], [11, 12]  # two branches under the anchor 5
    whole = model(torch.tensor([prompt + [5] + path_a])).logits[0, -1]
    flat = prompt + [5] + path_a + path_b  # a tree laid out flat, branch b after branch a
    n = len(prompt)
    allowed = torch.ones(len(flat), len(flat), dtype=torch.bool).tril()
    allowed[n + 4 :, n + 1 : n + 4] = False  # branch b does not see branch a
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    positions = torch.tensor([*range(n + 4), n + 1, n + 2])
    alone_b = model(torch.tensor([prompt + [5] + path_b])).logits[0, -1]
    masked = model(torch.tensor([flat]), attention_mask=mask[None, None], position_ids=positions[None]).logits[0]
    # branch a comes first: unaffected, up to the rounding of another operation order (tests/tolerances.py)
    text = model.config.get_text_config()
    inner = max(text.vocab_size, text.intermediate_size, text.hidden_size)  # the widest reduction
    bound = tolerances.float64_forward_error(layers=text.num_hidden_layers + 1, inner=inner)
    assert torch.allclose(masked[n + 3], whole, atol=bound * whole.abs().max().item(), rtol=0)
    assert (masked[-1] - alone_b).abs().max() > 1e-2  # branch b leaks through the recurrence


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_features_equal_per_document(models, family):
    model = copy.deepcopy(models(family)[0])
    if family not in MOE:  # float64: any difference is a leak, not rounding (grouped expert matmuls lack it)
        model = model.double()
    tolerance = 1e-5 if family in MOE else 1e-9
    target = TargetModel(model, layer_ids=[1, 2])
    gen = torch.Generator().manual_seed(1)
    lengths = [9, 14, 7]
    ids = torch.randint(0, target.vocab_size, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    packed = target.features(ids, pos)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for a, b in zip(starts, starts[1:]):
        alone = target.features(ids[a:b])
        for got, want in ((packed.context[a:b], alone.context), (packed.last_hidden[a:b], alone.last_hidden)):
            assert (got - want).abs().max() / want.abs().max() < tolerance
    if family in HYBRID:
        assert not target.packs_documents  # recurrent state would cross documents
    if family == "gpt_oss":
        assert not target.packs_documents and target.packing_error > 1e-2  # its mask ignores position restarts
    if family in ("qwen3", "llama"):
        assert target.packs_documents


# -- planner -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(name):
        if name not in made:
            made[name] = root / name
            build_family(name, made[name])
        return made[name]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_counts_parameters_exactly_and_plans(models, folders, family):
    from dflash_trainer.config import load_config
    from dflash_trainer.planner.report import plan_for_config
    from dflash_trainer.planner.shapes import load_target_shape, target_param_count

    model, _ = models(family)
    shape = load_target_shape(str(folders(family)))
    assert target_param_count(shape) == sum(p.numel() for p in model.parameters())
    assert shape.packs_documents == TargetModel(model, layer_ids=[1, 2]).packs_documents  # priced as it runs
    if family in MOE:  # activations priced for the routed experts, not one dense width
        assert shape.num_experts == 4 and shape.mlp_active_width >= 2 * 32
    cfg = load_config(
        ["tiny-demo"], [f"target.path={folders(family)}", "target.layer_ids=[1,2]", "target.num_feature_layers=2"]
    )
    plan = plan_for_config(cfg)
    assert plan.devices and plan.chunk > 0


def test_published_moe_parameter_counts():
    """The planner's count for published MoE configs (the issue's reference numbers)."""
    from dflash_trainer.planner.shapes import TargetShape, target_param_count

    gpt_oss_20b = dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        sliding_window=128,
        tie_word_embeddings=False,
    )
    shape = TargetShape.from_config(gpt_oss_20b, "gpt-oss-20b")
    assert round(target_param_count(shape) / 1e8) == 209  # 20.9 B, not the 2.4 B of a dense MLP
    assert shape.mlp_active_width == 4 * 2880


# -- the whole flow per family ---------------------------------------------------------------------


def _write_data(path, n=12):
    import json

    gen = torch.Generator().manual_seed(2)
    words = ["def", "return", "self", "import", "class", "value", "for", "in", "range", "print", "if", "None"]
    lines = []
    for i in range(n):
        text = " ".join(words[int(j)] for j in torch.randint(len(words), (40,), generator=gen))
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": text}]})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole_flow(folders, tmp_path, family):
    """Train two steps (with eval), speculative chain and DDTree against plain greedy, both exports and
    their check, and the preflight with topology.preflight=false."""
    import io

    from dflash_trainer.config import load_config
    from dflash_trainer.drafter_folder import save_drafter
    from dflash_trainer.export.formats import check_export, export_checkpoint, load_export
    from dflash_trainer.planner.preflight import preflight
    from dflash_trainer.training.setup import prepare
    from dflash_trainer.training.trainer import Trainer

    folder = folders(family)
    cfg = load_config(
        ["tiny-demo"],
        [
            f"target.path={folder}",
            "target.layer_ids=[1,2]",
            "target.num_feature_layers=2",
            "drafter.num_layers=1",
            "drafter.block_size=4",
            f"data.train_files=[{_write_data(tmp_path / 'data.jsonl')}]",
            "data.seq_len=96",
            "data.max_anchors=4",
            "data.max_eval_rows=1",
            "train.max_steps=2",
            "train.eval_every=2",
            "train.save_every=2",
            "topology.preflight=false",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    cfg = preflight(cfg, out=io.StringIO())
    assert cfg.loss.chunk_size > 0
    target, tok, rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(
        cfg, target, tok, rows, eval_rows, out_dir=tmp_path / "run", target_path=str(folder), progress=False
    )
    summary = trainer.fit()
    assert summary
    drafter = trainer.drafter.eval()
    if family == "gemma3":
        assert drafter.spec.logit_softcap == 30.0
    ckpt = save_drafter(drafter, tmp_path / "ckpt", target=target, target_path=str(folder))

    new_tokens = 12 if family in HYBRID else 30
    greedy, _ = target_greedy(target.model, PROMPT, new_tokens, [0])
    decoder = SpeculativeDecoder(target, drafter, [0])
    for mode in ("chain", "ddtree"):
        assert decoder.generate(PROMPT, new_tokens, mode, budget=6).tokens == greedy

    for fmt in ("zlab", "speculators"):
        kwargs = {"target_model": target.model} if fmt == "speculators" else {}
        if family == "gemma3" and fmt == "speculators":  # scaled embeddings: speculators reloads the raw table
            from dflash_trainer.errors import UserError

            with pytest.raises(UserError, match="reloads embed_tokens from the verifier's raw table"):
                export_checkpoint(ckpt, tmp_path / fmt, fmt, **kwargs)
            kwargs["allow_mismatch"] = True
        out = export_checkpoint(ckpt, tmp_path / fmt, fmt, **kwargs)
        report = check_export(out)
        assert report.problems == []
        if kwargs.get("allow_mismatch"):
            assert any("accepted at export" in n and "raw table" in n for n in report.notes)
        loaded = load_export(out, target)
        assert loaded.spec.logit_options == drafter.spec.logit_options
        if family == "gemma3":  # an export that drops the recorded transforms is caught
            import json

            config = json.loads((out / "config.json").read_text())
            config.pop("target_transforms", None)
            config.get("dflash_config", {}).pop("target_transforms", None)
            (out / "config.json").write_text(json.dumps(config))
            problems = check_export(out).problems
            assert any("embedding_scale" in p for p in problems) and any("logit_softcap" in p for p in problems)


# -- DSpark's drafts on every family -----------------------------------------------------------------


class OracleMarkovDrafts(OracleDrafts):
    """DSpark's shape of proposal on the oracle's drafts: B drafts a block (sample_from_anchor), and a
    DDTree whose children come from a distribution conditioned on their parent's token (the oracle's
    next reference token, often corrupted, below a node on the reference path; noise below any other)."""

    def _draft(self, anchor, anchor_pos, drafter_cache):
        from dflash_trainer.inference.ddtree import build_conditioned_tree

        depth = BLOCK  # B drafts
        vocab = self.target.vocab_size

        def slot(i, on_path):  # the distribution of the draft at row position i
            logits = torch.randn(vocab, generator=self.gen)
            if on_path and i < len(self.reference):
                logits[self.reference[i]] = 10.0
                if torch.rand(1, generator=self.gen) < 0.3:
                    logits[int(torch.randint(vocab, (1,), generator=self.gen))] = 11.0
            return torch.log_softmax(logits, dim=-1)

        chain, log_probs = [], []
        for j in range(depth):
            log_probs.append(slot(anchor_pos + 1 + j, True))
            chain.append(int(log_probs[-1].argmax()))

        def expand(token, on_path, d):  # children of a node at depth d (row position anchor_pos + d)
            i = anchor_pos + d
            on = on_path and i < len(self.reference) and token == self.reference[i]
            return slot(i + 1, on), on

        root = (log_probs[0], True)
        return torch.stack(log_probs), chain, lambda budget: build_conditioned_tree(root, expand, depth, budget)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dspark_speculative_equals_greedy(models, family):
    """DSpark on every family, chain and DDTree: a real DSpark drafter (its Markov walk and
    node-conditioned tree over this family's features) and the oracle's Markov-shaped drafts (so that
    rounds of B drafts accept fully, partly and off the tree's top branch) give plain greedy."""
    from dflash_trainer.config.schema import DrafterConfig
    from dflash_trainer.model.drafter import DrafterSpec
    from dflash_trainer.variants import make_drafter

    model, greedy = models(family)
    if family in HYBRID:
        greedy = greedy[:HYBRID_TOKENS]
    target = TargetModel(model, layer_ids=[1, 2])
    cfg = DrafterConfig(num_layers=1, block_size=BLOCK, variant="dspark", dspark={"markov_rank": 8})
    spec = DrafterSpec.from_target(model.config, cfg, num_features=2, mask_token_id=1)
    torch.manual_seed(0)
    drafter = make_drafter(spec, target.embed_tokens, target.lm_head_weight).eval()
    drafter.markov_head.markov_w1.weight.data.normal_(0, 1.0)  # a bias that moves the drafts
    real = SpeculativeDecoder(target, drafter, [0])
    oracle = OracleMarkovDrafts(target, PROMPT + greedy)
    for mode, budget in (("chain", 1), ("ddtree", 10)):
        out = real.generate(PROMPT, len(greedy), mode, budget=budget)
        assert out.tokens == greedy and max(out.drafted) == BLOCK, mode  # B drafts a block
        result = oracle.generate(PROMPT, len(greedy), mode, budget=budget)
        assert result.tokens == greedy, mode
        # rounds of several accepted drafts and partial rounds (a full round of 6 is a 12% event per round)
        assert max(result.accepted) >= BLOCK - 2 and min(result.accepted) < BLOCK, mode


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dflash2_speculative_equals_greedy(models, family):
    """DFlash2 on every family, chain and DDTree: a real DFlash2 drafter (convolutions away from the
    identity, the selector walk and its DDTree of K candidates a slot over this family's features)
    gives plain greedy."""
    from dflash_trainer.config.schema import DrafterConfig
    from dflash_trainer.model.drafter import DrafterSpec
    from dflash_trainer.variants import make_drafter

    model, greedy = models(family)
    if family in HYBRID:
        greedy = greedy[:HYBRID_TOKENS]
    target = TargetModel(model, layer_ids=[1, 2])
    cfg = DrafterConfig(
        num_layers=1, block_size=BLOCK, variant="dflash2", dflash2={"selector_rank": 8, "selector_top_k": 4}
    )
    spec = DrafterSpec.from_target(model.config, cfg, num_features=2, mask_token_id=1)
    torch.manual_seed(0)
    drafter = make_drafter(spec, target.embed_tokens, target.lm_head_weight).eval()
    for conv in (drafter.layers[0].attention_conv, drafter.layers[0].mlp_conv):
        conv.kernel_projection.weight.data.normal_(0, 0.1)
    drafter.candidate_selector.predecessor_codebook.data.normal_(0, 1.0)  # a selector that moves the drafts
    decoder = SpeculativeDecoder(target, drafter, [0])
    for mode, budget in (("chain", 1), ("ddtree", 10)):
        out = decoder.generate(PROMPT, len(greedy), mode, budget=budget)
        assert out.tokens == greedy and max(out.drafted) == BLOCK - 1, mode
