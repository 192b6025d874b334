"""The speculative benchmark behind ``dflash-train speculate``: every prompt decoded by the target alone
and speculatively (``inference.speculative``), per verification mode.

Greedy (``temperature == 0``): the speculative output must equal the target's plain greedy output token
for token; a prompt whose outputs differ counts as a mismatch of that mode. Sampled
(``temperature > 0``): both sample with seed ``seed + i`` for prompt i (speculative sampling is
lossless in distribution, not token for token, so nothing is compared). Per mode:

    tau              = sum over rounds of (accepted + 1) / rounds
    tokens_per_s     = tokens generated / seconds decoding, over all prompts
    speedup          = tokens_per_s / the target alone's tokens_per_s
    drafts_per_round = drafts proposed / rounds (below B - 1 where a confidence head stops a chain)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..model.drafter import DFlashDrafter
from ..model.target import TargetModel
from ..variants import block_span
from .sampling import verification_policy
from .speculative import DecodeResult, SpeculativeDecoder, target_greedy, target_sample


@dataclass
class _Totals:
    """One mode's (or the target alone's) sums over all prompts."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0  # accepted drafts plus one bonus token per round
    drafted: int = 0
    mismatches: int = 0

    def add(self, res: DecodeResult, reference: list[int]) -> None:
        self.tokens += len(res.tokens)
        self.seconds += res.seconds
        self.rounds += len(res.accepted)
        self.accepted += sum(a + 1 for a in res.accepted)
        self.drafted += sum(res.drafted)
        self.mismatches += int(res.tokens != reference)


@dataclass(frozen=True)
class SpeculateBench:
    """What ``speculate_bench`` measured.

    records: one dict per prompt, in prompt order: ``source``, ``target_tokens`` (tokens the target
        alone generated), ``text`` (its output, special tokens skipped), ``<mode>_tau`` per mode and,
        when sampling, ``<mode>_text``.
    summary: ``prompts``, ``max_new_tokens``, ``target_tokens_per_s``, ``temperature``, ``top_p``,
        ``seed`` and ``modes``: per mode name (``chain``, ``ddtree-<budget>``) ``tau``,
        ``tokens_per_s``, ``speedup``, ``mismatches`` (None when sampling), ``drafts_per_round``, and
        for ``chain`` ``target_tokens_saved`` (drafts a confidence head kept from the target).
    """

    records: list[dict]
    summary: dict

    @property
    def mismatches(self) -> int:
        """Prompts, summed over modes, whose speculative output differs from the target's (0 when sampling)."""
        return sum(m["mismatches"] or 0 for m in self.summary["modes"].values())


def speculate_bench(
    target: TargetModel,
    drafter: DFlashDrafter,
    tokenizer,
    prompts: Sequence[tuple[str, list[int]]],
    eos_ids: list[int],
    *,
    mode: str = "chain",
    budgets: Sequence[int] = (64,),
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    confidence_threshold: float = 0.0,
) -> SpeculateBench:
    """Decode ``prompts`` (``[(source, prompt token ids)]``, e.g. ``inference.prompts.chat_prompts``)
    with ``target`` alone and speculatively with ``drafter``: once with ``mode == "chain"``, once per
    DDTree budget in ``budgets`` with ``mode == "ddtree"``. ``tokenizer`` decodes the output texts;
    ``confidence_threshold > 0`` stops a block's chain where a confidence head (DSpark) predicts
    rejection. Greedy at ``temperature == 0``, else sampling with ``temperature``/``top_p``."""
    if mode not in ("chain", "ddtree"):
        raise ValueError(f"mode must be 'chain' or 'ddtree', got {mode!r}")
    sampling = temperature > 0
    options = {"confidence_threshold": confidence_threshold} if confidence_threshold > 0 else {}
    decoder = SpeculativeDecoder(target, drafter, eos_ids, **options)
    model = target.model
    modes = [("chain", None)] if mode == "chain" else [("ddtree", b) for b in budgets]
    names = [m if b is None else f"{m}-{b}" for m, b in modes]
    baseline, totals = _Totals(), {name: _Totals() for name in names}
    records = []
    for i, (source, ids) in enumerate(prompts):
        if sampling:
            ref, secs = target_sample(model, ids, max_new_tokens, eos_ids, temperature, top_p, seed + i)
        else:
            ref, secs = target_greedy(model, ids, max_new_tokens, eos_ids)
        baseline.tokens += len(ref)
        baseline.seconds += secs
        record = {"source": source, "target_tokens": len(ref), "text": tokenizer.decode(ref, skip_special_tokens=True)}
        for name, (m, budget) in zip(names, modes):
            policy = verification_policy(temperature, top_p, seed + i)
            res = decoder.generate(ids, max_new_tokens, m, budget=budget or 1, policy=policy)
            totals[name].add(res, ref)
            record[f"{name}_tau"] = res.tau
            if sampling:
                record[f"{name}_text"] = tokenizer.decode(res.tokens, skip_special_tokens=True)
        records.append(record)
    base_rate = baseline.tokens / baseline.seconds
    summary = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "target_tokens_per_s": base_rate,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "modes": {},
    }
    max_drafts = block_span(drafter.spec) - 1
    for name, t in totals.items():
        rate = t.tokens / t.seconds
        summary["modes"][name] = {
            "tau": t.accepted / max(1, t.rounds),
            "tokens_per_s": rate,
            "speedup": rate / base_rate,
            # sampled outputs are compared in distribution (tests), not token for token
            "mismatches": None if sampling else t.mismatches,
            "drafts_per_round": t.drafted / max(1, t.rounds),
        }
        if name == "chain":  # the drafts a block stopped early by the confidence head did not send to the target
            summary["modes"][name]["target_tokens_saved"] = t.rounds * max_drafts - t.drafted
    return SpeculateBench(records, summary)
