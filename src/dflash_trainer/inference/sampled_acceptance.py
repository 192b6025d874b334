"""Acceptance at temperature T > 0, two ways (``dflash-train eval --temperature T``).

With speculative sampling (``inference.sampling``) the drafts are the drafter's own tokens (its argmax
chain, its DDTree) and the target samples its token at every verified position; a draft is accepted
when the target's sample equals it. For one block anchored at position a, with q_T the target's
sampling distribution (temperature, top-p):

    chain:   P(slot k accepted | slots < k accepted) = q_T(d_k | x_<=a, d_1..d_{k-1})
             E[accepted] = sum_k prod_{j<=k} q_T(d_j | x_<=a, d_<j)             (per slot, then chained)
    DDTree:  P(walk reaches node n) = prod over n's path of q_T(token | x_<=a, ancestors)
             E[accepted] = sum over the tree's nodes of P(walk reaches node)
    tau = 1 + E[accepted]

**Expected** (``expected_sampled_acceptance``): these sums along held-out responses, at the same
sampled anchors as the greedy report. The drafts are read from the teacher-forced scorer
(``teacher_forced_blocks``); the target's conditionals are exact: one target pass over each document
keeps a KV cache, then every block's chain and tree nodes are scored against the cache up to their
anchor and their own ancestors (a tree attention mask), many blocks per pass. The trees of smaller
budgets are prefixes of the largest one (best-first order), so one tree per block serves every budget.

**Measured** (``measured_sampled_acceptance``): real speculative sampling (``SpeculativeDecoder`` with
``SampledVerification``) from each evaluation document's prompt; tau = mean(accepted + 1) over all
rounds. The two differ only in which contexts the anchors sit in (held-out text vs the decoder's own
samples); at the same contexts the expected value is the mean of the measured one (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from ..data.blocks import sample_anchors
from ..data.packing import doc_ids_from_positions
from ..model.drafter import DFlashDrafter
from ..variants import block_span
from .acceptance import MAX_LOGIT_ELEMENTS, EvalInputError, teacher_forced_blocks
from .sampling import SampledVerification, sampling_probs
from .speculative import SpeculativeDecoder, _forward_cache_kwarg


def _check_sampling(temperature: float, top_p: float) -> None:
    if not temperature > 0:
        raise EvalInputError(f"--temperature must be > 0 for sampled acceptance, got {temperature}")
    if not 0 < top_p <= 1:
        raise EvalInputError(f"--top-p must be in (0, 1], got {top_p}")


@torch.no_grad()
def block_expectations(
    target,
    drafter: DFlashDrafter,
    row,
    anchors: torch.Tensor,
    *,
    temperature: float,
    top_p: float = 1.0,
    budgets: Sequence[int] = (),
    attention_backend: str = "dense",
    max_logit_elements: int = MAX_LOGIT_ELEMENTS,
) -> dict[str, torch.Tensor]:
    """Exact per-block acceptance under target sampling for ``anchors`` ``[n]`` of a packed ``row``
    (anchors as ``teacher_forced_blocks`` takes them). Returns float64 CPU tensors:

        slot_probs  [n, B-1]           q_T(d_k | context, d_<k) along the drafter's argmax chain
        chain       [n]                E[accepted] of the chain = sum_k prod_{j<=k} slot_probs
        ddtree      [n, len(budgets)]  E[accepted] of the DDTree of each budget
    """
    return block_expectations_at(
        target,
        drafter,
        row,
        anchors,
        temperatures=[temperature],
        top_p=top_p,
        budgets=budgets,
        attention_backend=attention_backend,
        max_logit_elements=max_logit_elements,
    )[0]


@torch.no_grad()
def block_expectations_at(
    target,
    drafter: DFlashDrafter,
    row,
    anchors: torch.Tensor,
    *,
    temperatures: Sequence[float],
    top_p: float = 1.0,
    budgets: Sequence[int] = (),
    attention_backend: str = "dense",
    max_logit_elements: int = MAX_LOGIT_ELEMENTS,
) -> list[dict[str, torch.Tensor]]:
    """``block_expectations`` at each of ``temperatures``, from one pass: the drafts, trees and target
    logits do not depend on T, only the sampling distributions taken of the logits do."""
    b = block_span(drafter.spec)  # D = b - 1 drafts a block (DSpark's sample_from_anchor: B)
    budgets = list(budgets)
    max_budget = max(budgets, default=0)
    # 1. drafts: the chain (argmax per slot) and the largest tree of each block, in anchor order
    blocks = []  # per anchor: (tokens, parents, depths) of the chain nodes followed by the tree nodes
    for scored in teacher_forced_blocks(
        target, drafter, row, anchors, attention_backend=attention_backend, max_logit_elements=max_logit_elements
    ):
        chain, tree_of = scored.draft_logits.argmax(-1).tolist(), scored.tree_of  # [g, D]
        for j, drafts in enumerate(chain):
            tokens, parents, depths = list(drafts), [-1, *range(b - 2)], list(range(1, b))
            if max_budget:
                tree = tree_of(j, max_budget)  # as decoding builds it (DSpark: node-conditioned)
                tokens += tree.tokens
                parents += [-1 if p < 0 else b - 1 + p for p in tree.parents]
                depths += tree.depths
            blocks.append((tokens, parents, depths))
    # 2. the target's sampling probability of every node given its anchor's context and its ancestors
    node_probs = _node_probabilities(target, row, anchors, blocks, temperatures, top_p, max_logit_elements)
    return [_expectations(blocks, per_block, b, budgets) for per_block in node_probs]


def _expectations(blocks, node_probs, b: int, budgets: list[int]) -> dict[str, torch.Tensor]:
    """``block_expectations``' tensors from each block's node probabilities ``[nodes]``."""
    slot_probs, chain, ddtree = [], [], []
    for (_, parents, _), q in zip(blocks, node_probs):
        reach = []
        for parent, prob in zip(parents, q.tolist()):
            reach.append(prob * (1.0 if parent < 0 else reach[parent]))
        slot_probs.append(q[: b - 1])
        chain.append(sum(reach[: b - 1]))
        tree_reach = reach[b - 1 :]
        ddtree.append([sum(tree_reach[:budget]) for budget in budgets])
    n = len(blocks)
    return {
        "slot_probs": torch.stack(slot_probs) if n else torch.zeros(0, b - 1, dtype=torch.float64),
        "chain": torch.tensor(chain, dtype=torch.float64),
        "ddtree": torch.tensor(ddtree, dtype=torch.float64).reshape(n, len(budgets)),
    }


def _node_probabilities(target, row, anchors, blocks, temperatures, top_p, max_logit_elements) -> list[list]:
    """Per temperature T, for each block (anchor order): ``[nodes]`` float64 q_T(node token | context <=
    anchor, ancestors).

    One target pass per document fills a KV cache and gives the anchors' own logits (the distribution
    of depth-1 nodes); then the nodes of several blocks go through the target together, each node
    attending to the cache up to its anchor and to its own ancestors; the cache is cropped back after."""
    model = target.model
    dev = model.device
    cache_kwarg = _forward_cache_kwarg(model)
    ids, pos = row.input_ids.cpu(), row.position_ids.cpu()
    doc = doc_ids_from_positions(pos)
    vocab = target.vocab_size
    out: list[list[torch.Tensor]] = [[] for _ in temperatures]
    anchor_list = anchors.tolist()
    i = 0
    while i < len(anchor_list):
        d = int(doc[anchor_list[i]])
        start = int((doc == d).nonzero()[0])
        end = int((doc == d).nonzero()[-1]) + 1
        members = [k for k in range(i, len(anchor_list)) if int(doc[anchor_list[k]]) == d]
        i = members[-1] + 1
        local = torch.tensor([anchor_list[k] - start for k in members])
        cache = DynamicCache(config=model.config)
        first = model(
            input_ids=ids[None, start:end].to(dev),
            position_ids=pos[None, start:end].to(dev),
            use_cache=True,
            logits_to_keep=local.to(dev),
            **{cache_kwarg: cache},
        )
        anchor_logits = first.logits[0]  # [m, V]: the depth-1 nodes' distribution
        length = end - start
        per_pass = max(1, max_logit_elements // vocab)
        k = 0
        while k < len(members):  # a group of blocks per pass, at least one block
            group, size = [], 0
            while k < len(members) and (not group or size + len(blocks[members[k]][0]) <= per_pass):
                group.append(k)
                size += len(blocks[members[k]][0])
                k += 1
            tokens, positions, offsets = [], [], []
            allowed = torch.zeros(size, length + size, dtype=torch.bool)
            for g in group:
                node_tokens, parents, depths = blocks[members[g]]
                o = len(tokens)
                offsets.append(o)
                a = int(local[g])
                allowed[o : o + len(node_tokens), : a + 1] = True  # the document up to the anchor
                for n, parent in enumerate(parents):
                    allowed[o + n, length + o + n] = True
                    while parent >= 0:  # and its ancestors in this block
                        allowed[o + n, length + o + parent] = True
                        parent = parents[parent]
                tokens += node_tokens
                positions += [int(pos[start + a]) + depth for depth in depths]
            dtype = model.dtype
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            logits = model(
                input_ids=torch.tensor([tokens], device=dev),
                position_ids=torch.tensor([positions], device=dev),
                attention_mask=mask[None, None].to(dev),
                use_cache=True,
                **{cache_kwarg: cache},
            ).logits[0]
            cache.crop(-size)  # drop the scored nodes: back to the document alone
            for t, per_block in zip(temperatures, out):
                anchor_probs = sampling_probs(anchor_logits[group], t, top_p)  # [len(group), V]
                probs = sampling_probs(logits, t, top_p)  # [size, V]: row n is the distribution after node n
                for j, (g, o) in enumerate(zip(group, offsets)):
                    node_tokens, parents, _ = blocks[members[g]]
                    rows = torch.stack([anchor_probs[j] if p < 0 else probs[o + p] for p in parents])
                    picked = rows.gather(1, torch.tensor(node_tokens, device=rows.device)[:, None])[:, 0]
                    per_block.append(picked.double().cpu())
    return out


@torch.no_grad()
def expected_sampled_acceptance(
    target,
    drafter: DFlashDrafter,
    rows: Sequence,
    *,
    temperature: float,
    top_p: float = 1.0,
    budgets: Sequence[int] = (),
    max_blocks_per_row: int = 64,
    seed: int = 1234,
    attention_backend: str = "dense",
    max_logit_elements: int = MAX_LOGIT_ELEMENTS,
) -> dict:
    """Expected tau under target sampling along held-out ``rows``, at the anchors ``acceptance_report``
    draws with the same ``seed``. Returns (B = block size, N = blocks):

        tau                     chain tau, 1 + mean E[accepted]
        slot_acceptance         [B-1]  mean q_T(d_k | context, d_<k): slot k's acceptance given slots < k accepted
        reach                   [B-1]  mean P(accepted >= k); sums to tau - 1
        budgets, ddtree_tau     DDTree tau per budget
        blocks
    """
    _check_sampling(temperature, top_p)
    b = block_span(drafter.spec)  # D = b - 1 drafts a block (DSpark's sample_from_anchor: B)
    gen = torch.Generator().manual_seed(seed)
    parts = []
    was_training = drafter.training
    drafter.eval()
    try:
        for row in rows:
            doc = doc_ids_from_positions(row.position_ids.cpu())
            anchors = sample_anchors(row.loss_mask.cpu(), doc, b, max_blocks_per_row, gen)
            if anchors.numel():
                parts.append(
                    block_expectations(
                        target,
                        drafter,
                        row,
                        anchors,
                        temperature=temperature,
                        top_p=top_p,
                        budgets=budgets,
                        attention_backend=attention_backend,
                        max_logit_elements=max_logit_elements,
                    )
                )
    finally:
        drafter.train(was_training)
    if not parts:
        raise EvalInputError(f"no valid block of {b} tokens in {len(rows)} evaluation rows")
    slot = torch.cat([p["slot_probs"] for p in parts])  # [N, B-1]
    return {
        "tau": 1 + torch.cat([p["chain"] for p in parts]).mean().item(),
        "slot_acceptance": slot.mean(0).tolist(),
        "reach": slot.cumprod(1).mean(0).tolist(),
        "budgets": list(budgets),
        "ddtree_tau": (1 + torch.cat([p["ddtree"] for p in parts]).mean(0)).tolist() if budgets else [],
        "blocks": slot.shape[0],
    }


def document_prompts(rows: Sequence, limit: int | None = None) -> list[list[int]]:
    """The prompt of each document in ``rows``: its tokens before its first loss position (documents
    that start with a loss token, e.g. the tail of a split document, have none and are skipped)."""
    prompts = []
    for row in rows:
        ids, pos, mask = row.input_ids.cpu(), row.position_ids.cpu(), row.loss_mask.cpu()
        doc = doc_ids_from_positions(pos)
        for d in doc.unique().tolist():
            where = (doc == d).nonzero()[:, 0]
            loss = mask[where].nonzero()[:, 0]
            if loss.numel() and int(loss[0]) > 0:
                prompts.append(ids[where[: int(loss[0])]].tolist())
                if limit is not None and len(prompts) >= limit:
                    return prompts
    return prompts


def _tau_summary(accepted: list[int]) -> dict:
    """tau = mean(accepted + 1) over rounds, with its standard error (rounds treated as independent)."""
    n = len(accepted)
    if not n:
        return {"tau": None, "stderr": None, "rounds": 0}
    mean = sum(a + 1 for a in accepted) / n
    var = sum((a + 1 - mean) ** 2 for a in accepted) / max(1, n - 1)
    return {"tau": mean, "stderr": math.sqrt(var / n), "rounds": n}


@torch.no_grad()
def measured_sampled_acceptance(
    target,
    drafter: DFlashDrafter,
    prompts: Sequence[list[int]],
    eos_ids: list[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    budgets: Sequence[int] = (),
    max_new_tokens: int = 128,
    seed: int = 1234,
) -> dict:
    """Real speculative sampling of ``prompts``, chain and DDTree per budget; prompt i is sampled with
    seed ``seed + i`` in every mode. Returns ``{"chain": {tau, stderr, rounds}, "ddtree": [... per budget],
    "budgets", "prompts"}``."""
    _check_sampling(temperature, top_p)
    if not prompts:
        raise EvalInputError("no evaluation prompt (a document whose first token is not a loss token)")
    decoder = SpeculativeDecoder(target, drafter, eos_ids)
    was_training = drafter.training
    drafter.eval()
    try:
        modes = [("chain", 1), *(("ddtree", budget) for budget in budgets)]
        accepted = {m: [] for m in modes}
        for i, prompt in enumerate(prompts):
            prefilled = decoder.prefill(prompt)  # one prefill for every mode
            for mode, budget in modes:
                policy = SampledVerification(temperature, top_p, seed + i)
                result = decoder.generate(prompt, max_new_tokens, mode, budget, policy, prefilled)
                accepted[(mode, budget)] += result.accepted
    finally:
        drafter.train(was_training)
    return {
        "chain": _tau_summary(accepted[("chain", 1)]),
        "ddtree": [_tau_summary(accepted[("ddtree", budget)]) for budget in budgets],
        "budgets": list(budgets),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


def sampled_report(
    target,
    drafter: DFlashDrafter,
    rows: Sequence,
    eos_ids: list[int],
    *,
    temperature: float,
    top_p: float = 1.0,
    budgets: Sequence[int] = (),
    prompts: int = 8,
    max_new_tokens: int = 128,
    max_blocks_per_row: int = 64,
    seed: int = 1234,
    attention_backend: str = "dense",
) -> dict:
    """tau(T) both ways, chain and per DDTree budget: expected along the held-out ``rows``
    (``expected_sampled_acceptance``) and measured by real speculative sampling from the first
    ``prompts`` documents' prompts (``measured_sampled_acceptance``). Returns ``{"temperature",
    "top_p", "expected", "measured"}``, the ``sampling`` section of ``dflash-train eval``'s report."""
    expected = expected_sampled_acceptance(
        target,
        drafter,
        rows,
        temperature=temperature,
        top_p=top_p,
        budgets=budgets,
        max_blocks_per_row=max_blocks_per_row,
        seed=seed,
        attention_backend=attention_backend,
    )
    measured = measured_sampled_acceptance(
        target,
        drafter,
        document_prompts(rows, prompts),
        eos_ids,
        temperature=temperature,
        top_p=top_p,
        budgets=budgets,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    return {"temperature": temperature, "top_p": top_p, "expected": expected, "measured": measured}


def chain_tau_both_ways(
    target,
    drafter: DFlashDrafter,
    rows: Sequence,
    eos_ids: list[int],
    *,
    temperature: float,
    prompts: int = 8,
    max_new_tokens: int = 64,
    max_blocks_per_row: int = 64,
    seed: int = 1234,
    attention_backend: str = "dense",
) -> dict:
    """Chain tau(T) expected along ``rows`` and measured from the first ``prompts`` documents' prompts:
    ``{"expected", "measured", "measured_stderr", "rounds"}`` (the demo's summary line)."""
    report = sampled_report(
        target,
        drafter,
        rows,
        eos_ids,
        temperature=temperature,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        max_blocks_per_row=max_blocks_per_row,
        seed=seed,
        attention_backend=attention_backend,
    )
    measured = report["measured"]["chain"]
    return {
        "expected": report["expected"]["tau"],
        "measured": measured["tau"],
        "measured_stderr": measured["stderr"],
        "rounds": measured["rounds"],
    }
