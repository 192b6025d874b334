"""Speculative decoding (chain and DDTree) is lossless, and its tau matches teacher forcing."""

import json
import math

import pytest
import tolerances
import torch
from cli_runs import as_process, in_process
from trained import EOS, train_on_greedy

from dflash_trainer.data.blocks import build_blocks
from dflash_trainer.inference.speculative import SpeculativeDecoder
from dflash_trainer.variants import block_span


@pytest.fixture(scope="module")
def trained():
    """A drafter trained briefly on the tiny target's own greedy continuations (so drafts get accepted),
    built once per test session (tests/trained.py)."""
    return train_on_greedy()


@pytest.mark.parametrize("mode, budget", [("chain", 1), ("ddtree", 1), ("ddtree", 8), ("ddtree", 64)])
def test_output_is_identical_to_target_greedy(trained, mode, budget):
    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    accepted_any = 0
    for ids, greedy in zip(trained["prompts"], trained["greedy"]):
        ref = greedy[:48]  # target_greedy(ids, 48): the first 48 tokens of the session's 64-token greedy
        res = decoder.generate(ids, 48, mode, budget=budget)
        assert res.tokens == ref
        accepted_any += sum(res.accepted)
    assert accepted_any > 0  # drafts were really accepted, so cache cropping/compaction was exercised


def test_chain_tau_equals_teacher_forcing_at_the_visited_anchors(trained):
    """Generate's per-round acceptance equals the batched training layout's teacher-forced acceptance
    at the same anchors (they measure the same thing for greedy decoding)."""
    target, drafter = trained["target"], trained["drafter"]
    decoder = SpeculativeDecoder(target, drafter, EOS)
    b = drafter.spec.block_size
    for ids in trained["prompts"][:4]:
        res = decoder.generate(ids, 48, "chain")
        row = torch.tensor(ids + res.tokens)
        positions = torch.arange(row.numel())
        feats = target.features(row, positions, need_teacher=True)
        anchors = torch.tensor([a for a in res.anchors if a + b <= row.numel()])
        blocks = build_blocks(
            row,
            positions,
            torch.ones_like(row),
            anchors,
            block_size=b,
            mask_token_id=drafter.spec.mask_token_id,
            gamma=4.0,
        )
        doc = torch.zeros_like(row)
        with torch.no_grad():
            hidden = drafter(
                blocks.input_ids,
                blocks.position_ids,
                feats.context,
                positions,
                drafter.build_masks(blocks.anchors, blocks.doc_ids, doc, "dense"),
            )
        draft = drafter.block_logits(hidden.view(len(anchors), b, -1)[:, 1:]).argmax(-1)
        greedy = (feats.last_hidden[blocks.teacher_index[:, 1:]] @ target.lm_head_weight.T).argmax(-1)
        teacher_forced = (draft == greedy).long().cumprod(1).sum(1).tolist()
        assert teacher_forced == res.accepted[: len(anchors)]


def speculate_cli(trained, prompts, out, *extra, process=True):
    """``dflash-train speculate`` with ``trained``'s drafter on ``prompts``: as its own process, or (a
    refusal before any work) in this one (tests/cli_runs.py)."""
    args = ["speculate", "--drafter", str(trained["ckpt"]), "--input", str(prompts), "--output", str(out), *extra]
    return as_process(*args, timeout=600) if process else in_process(*args)


def test_cli_reports_tau_speedup_and_agreement(trained, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in trained["records"][:3]))
    out = tmp_path / "spec.jsonl"
    result = speculate_cli(
        trained, prompts, out, "--mode", "ddtree", "--budget", "4", "--budget", "32", "--max-new-tokens", "32"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "spec.jsonl.report.json").read_text())
    assert set(report["modes"]) == {"ddtree-4", "ddtree-32"}
    for mode in report["modes"].values():
        assert mode["mismatches"] == 0 and 1.0 <= mode["tau"] <= 8 and mode["speedup"] > 0
    bad = speculate_cli(trained, prompts, tmp_path / "x.jsonl", "--mode", "ddtree", "--budget", "0", process=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "dflash-train: error: --budget must be >= 1, got 0"
    ]


def test_bad_arguments(trained):
    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([], 8)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        decoder.generate([1, 2, 3], 8, "ddtree", budget=0)


def test_generate_chain_tau_agrees_with_eval_decode_tau(trained):
    """On the same prompts, `speculate --mode chain` and `eval` (its decode-path tau, walked
    over the target's greedy responses) measure the same tau."""
    from dflash_trainer.data.documents import Document
    from dflash_trainer.data.packing import pack_documents
    from dflash_trainer.inference.acceptance import decode_path_acceptance

    target, drafter = trained["target"], trained["drafter"]
    decoder = SpeculativeDecoder(target, drafter, EOS)
    docs, rounds, total = [], 0, 0
    for i, (ids, greedy) in enumerate(zip(trained["prompts"], trained["greedy"])):
        ref = greedy[:48]  # target_greedy(ids, 48)
        res = decoder.generate(ids, 48, "chain")
        # the last round may run past the response; eval cannot place a block there, so compare the rest
        full = [(a, n) for a, n in zip(res.anchors, res.accepted) if a + drafter.spec.block_size <= len(ids) + len(ref)]
        rounds += len(full)
        total += sum(n + 1 for _, n in full)
        docs.append(Document(ids + ref, [0] * len(ids) + [1] * len(ref), "mem", i))
    rows = pack_documents(docs, 512, 0)
    report = decode_path_acceptance(target, drafter, rows)
    assert report["rounds"] == rounds
    assert report["tau"] == total / rounds  # a sum of integers (exact in float64), one division


# -- sampling (T > 0) -------------------------------------------------------------------------------

# The statistical tests below reject "distributed as the target" at this significance (the false-alarm
# rate). Seeds are fixed, so each test is deterministic; a correct sampler fails one only by a 1-in-1000
# chance of its seeds.
ALPHA = 1e-3
# The sample size is the one that detects a stated effect with a stated power, at ALPHA. Effect: Cohen's
# w^2 = sum_bins (p_bad - p)^2 / p >= EFFECT between the continuations' distribution and the target's,
# over the test's bins (w = 0.71, above Cohen's "large" 0.5). The negative control, AcceptDraftsInSupport,
# accepts every draft the target could have sampled, which moves the mass onto the drafter's own path
# (w^2 ~ 1 / P(the target samples the drafts) - 1); its rejection is asserted with every check, and its
# statistic printed (w^2 estimate: (stat - df) / SAMPLES). Pearson's statistic is noncentral
# chi-square(df, SAMPLES * w^2), and
#     power = P(ncx2(df, SAMPLES * EFFECT) > chi2.isf(ALPHA, df)) >= POWER  for every df <= MAX_DF
# holds at SAMPLES = 120 (lambda = 60: power 0.99995 at df 3, 0.9998 at df 5, 0.9993 at df 8; a
# sample of 60 or 90 would give only 0.85 or 0.986 at df 8). ``test_sample_size_has_the_stated_power``
# computes it; check_sampling_is_lossless asserts df <= MAX_DF and that the biased verifier is rejected.
EFFECT = 0.5
POWER = 0.999
MAX_DF = 8
SAMPLES = 120  # continuations per configuration (and as many for the biased verifier, same seeds)
CONTINUATION = 3  # tokens per continuation: the anchor and two verified positions


def chi_square_p_value(observed: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's chi-square goodness of fit: ``(p value, degrees of freedom)``; the survival function
    of chi-square(df) is the regularized upper incomplete gamma function Q(df/2, x/2)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2))), df


def chi_square_critical_value(alpha: float, df: int) -> float:
    """The statistic chi-square(df) exceeds with probability ``alpha`` (bisection of its survival function)."""
    lo, hi = 0.0, 10.0 * df + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def chi_square_sf(stat: float, df: float) -> float:
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def noncentral_chi_square_sf(stat: float, df: int, noncentrality: float) -> float:
    """P(chi-square(df, noncentrality) > stat): the Poisson(noncentrality / 2) mixture of central
    chi-square(df + 2j) survival functions."""
    half = noncentrality / 2
    return sum(
        math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) * chi_square_sf(stat, df + 2 * j) for j in range(400)
    )


def chi_square_power(samples: int, effect: float, df: int, alpha: float = ALPHA) -> float:
    """The power of Pearson's test at ``alpha`` against a distribution at Cohen's w^2 = ``effect``."""
    return noncentral_chi_square_sf(chi_square_critical_value(alpha, df), df, samples * effect)


def test_sample_size_has_the_stated_power():
    """SAMPLES detects an effect w^2 >= EFFECT with power >= POWER at ALPHA for every df <= MAX_DF
    (the computation written next to the constants), and a smaller sample would not."""
    assert abs(chi_square_critical_value(0.05, 1) - 3.841459) < 1e-5  # the tables' quantiles
    assert abs(chi_square_critical_value(1e-3, 5) - 20.515) < 1e-3
    # noncentral chi-square(1, lambda) is (Z + sqrt(lambda))^2: P(> c) = Phi(sqrt(l) - sqrt(c)) + Phi(-sqrt(l) - sqrt(c));
    # the bound: float64 (gammaincc's ~1e-14 relative error, 400 terms), far below 1e-9
    normal_cdf = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    for lam, c in [(4.0, 3.841459), (30.0, 10.828)]:
        want = normal_cdf(math.sqrt(lam) - math.sqrt(c)) + normal_cdf(-math.sqrt(lam) - math.sqrt(c))
        assert abs(noncentral_chi_square_sf(c, 1, lam) - want) < 1e-9, lam
    for df in range(3, MAX_DF + 1):
        assert chi_square_power(SAMPLES, EFFECT, df) >= POWER, df
    assert chi_square_power(SAMPLES * 3 // 4, EFFECT, MAX_DF) < POWER  # SAMPLES is not oversized by 4/3


def test_chi_square_p_value_matches_tables():
    # chi-square quantiles: 3.841 (df 1) and 11.070 (df 5) at 0.05, 6.635 (df 1) at 0.01
    assert abs(chi_square_p_value([0, 0], [1.0, 1.0])[0] - 0.157299) < 1e-5  # stat 2, df 1
    for stat, df, p in [(3.841459, 1, 0.05), (11.0705, 5, 0.05), (6.634897, 1, 0.01)]:
        got = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
        assert abs(got - p) < 1e-5


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.8, 0.9), (1.3, 0.5)])
def test_sampling_probs_match_transformers_warpers(temperature, top_p):
    """The target's sampling distribution is Hugging Face's: temperature, then TopPLogitsWarper."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    from dflash_trainer.inference.sampling import sampling_probs

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ref = torch.softmax(ref, dim=-1)
    ours = sampling_probs(logits, temperature, top_p)
    assert ours.dtype == torch.float64
    assert torch.equal(ours > 0, ref > 0)
    # both softmaxes of the same tempered logits in float64 (top-p renormalizing over at most 300):
    # tolerances.softmax_error relative to each probability, plus a sum of 300, on each side
    spread = ((logits.amax(-1) - logits.amin(-1)).max() / temperature).item()
    rel = 2 * (tolerances.softmax_error(300, spread, torch.float64) + tolerances.gamma(300, torch.float64))
    torch.testing.assert_close(ours, ref, rtol=rel, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_partial_sort_nucleus_equals_the_full_sort(dtype):
    """sampling_probs' nucleus from the top k tokens (k grown until they hold top_p) is the full sort's,
    exactly: peaked rows (k = 64 suffices), flat rows (k grows to the whole vocabulary) and rows in
    between, mixed in one batch (each row's k grows on its own), and batches of more dimensions."""
    from dflash_trainer.inference.sampling import sampling_probs, sampling_probs_by_sort

    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    scales = torch.tensor([0.01, 0.3, 1.0, 3.0, 8.0, 30.0], dtype=torch.float64)[:, None]
    logits = (torch.randn(6, vocab, generator=gen, dtype=torch.float64) * scales).to(dtype)
    for temperature, top_p in [(1.0, 0.9), (0.7, 0.5), (1.3, 0.999), (1.0, 1e-6)]:
        ours = sampling_probs(logits, temperature, top_p)
        assert torch.equal(ours, sampling_probs_by_sort(logits, temperature, top_p)), (temperature, top_p)
        for row in range(logits.shape[0]):  # one row at a time: peaked rows alone stop at k = 64
            assert torch.equal(sampling_probs(logits[row], temperature, top_p), ours[row])
        stacked = torch.stack([logits, logits.flip(0)])  # [2, 6, V]
        assert torch.equal(sampling_probs(stacked, temperature, top_p), torch.stack([ours, ours.flip(0)]))
    kept = (sampling_probs(logits, 1.0, 0.9) > 0).sum(-1)
    assert kept[0] > 64 * 16 and kept[-1] < 64  # both ends of the growth really happened


def test_sample_from_never_picks_a_zero_probability_token():
    from dflash_trainer.inference.sampling import sample_from

    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    assert sample_from(probs, 1e-12) == 1
    assert sample_from(probs, 0.25) == 1
    assert sample_from(probs, 0.2500001) == 3
    assert sample_from(probs, 1.0) == 3


class AcceptDraftsInSupport:
    """A deliberately biased verifier: accepts a draft whenever the target could have sampled it
    (probability > 0 after top-p) instead of sampling and comparing; samples only the bonus token."""

    def __init__(self, temperature, top_p, seed):
        from dflash_trainer.inference.sampling import SampledVerification

        self.inner = SampledVerification(temperature, top_p, seed)

    def rows(self, logits):
        from dflash_trainer.inference.sampling import sampling_probs

        probs = sampling_probs(logits, self.inner.temperature, self.inner.top_p)
        sample = self.inner.rows(logits)

        def pick(row, candidates):
            for token in candidates:
                if probs[row, token] > 0:
                    return token
            return sample(row, candidates)

        return pick


def _exact_continuations(model, prompt, temperature, top_p, length, min_prob):
    """Every continuation of ``length`` tokens (shorter when it ends with EOS) whose probability under
    plain target sampling is at least ``min_prob``, with that probability (float64, from the target's
    own full forward passes): ``{tokens: probability}``. The bins of the chi-square test."""
    from dflash_trainer.inference.sampling import sampling_probs

    frontier, done = {(): 1.0}, {}
    for _ in range(length):
        grown = {}
        for prefix, prob in frontier.items():
            if prefix and prefix[-1] in EOS:
                done[prefix] = prob
                continue
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1]
            q = sampling_probs(logits.double(), temperature, top_p) * prob
            for token in (q >= min_prob).nonzero()[:, 0].tolist():
                grown[(*prefix, token)] = float(q[token])
        frontier = grown
    return {**done, **frontier}


@pytest.fixture(scope="module")
def sampled_runs(trained):
    return sampled_runner(trained)


def sampled_runner(trained):
    """Continuations of one prompt by speculative sampling (seeds 0..SAMPLES-1) per configuration,
    correct and biased, cached so that the test of each configuration reads them."""
    from dflash_trainer.inference.sampling import SampledVerification

    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    # 16 tokens into a response, where the tiny target is sure enough that the likeliest continuations
    # hold a good part of the mass (at the start of a response it is nearly uniform at T = 1)
    first = trained["prompts"][0]
    prompt = first + trained["greedy"][0][:16]  # target_greedy(first, 16)
    prefilled = decoder.prefill(prompt)  # every sample decodes from a copy of one prefill
    cache = {}

    def runs(mode, budget, temperature, top_p, biased=False):
        key = (mode, budget, temperature, top_p, biased)
        if key not in cache:
            make = AcceptDraftsInSupport if biased else SampledVerification
            outs, rounds = [], []
            for seed in range(SAMPLES):
                res = decoder.generate(prompt, CONTINUATION, mode, budget, make(temperature, top_p, seed), prefilled)
                outs.append(tuple(res.tokens))
                rounds.append(res.accepted)
            cache[key] = outs, rounds
        return cache[key]

    return prompt, runs


@pytest.mark.parametrize(
    "mode, budget, temperature, top_p",
    [
        ("chain", 1, 1.0, 1.0),
        ("chain", 1, 0.7, 0.9),
        ("ddtree", 8, 1.0, 1.0),
        ("ddtree", 8, 0.7, 1.0),
    ],
)
def test_speculative_sampling_is_lossless_in_distribution(trained, sampled_runs, mode, budget, temperature, top_p):
    check_sampling_is_lossless(trained, sampled_runs, mode, budget, temperature, top_p)


def check_sampling_is_lossless(trained, sampled_runs, mode, budget, temperature, top_p):
    """Continuations of CONTINUATION tokens by speculative sampling follow plain target sampling
    (chi-square goodness of fit against the target's exact probabilities, p > ALPHA), while the
    biased verifier, on the same seeds, is rejected (p < ALPHA). Drafts must really be accepted,
    else the test would not exercise the walk."""
    prompt, runs = sampled_runs
    exact = _exact_continuations(trained["target"].model, prompt, temperature, top_p, CONTINUATION, 5 / SAMPLES)
    bins = list(exact)
    expected = [SAMPLES * exact[c] for c in bins] + [SAMPLES * (1 - sum(exact.values()))]
    p_values, stats = {}, {}
    for biased in (False, True):
        outs, rounds = runs(mode, budget, temperature, top_p, biased)
        counts = [outs.count(c) for c in bins]
        observed = counts + [SAMPLES - sum(counts)]
        p_values[biased], df = chi_square_p_value(observed, expected)
        stats[biased] = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
        if not biased:
            assert sum(sum(r) for r in rounds) > SAMPLES / 10  # drafts were accepted, many times
    print(f"df {df}: p {p_values[False]:.3g}; biased: p {p_values[True]:.3g}, w^2 ~ {(stats[True] - df) / SAMPLES:.2f}")
    assert 3 <= df <= MAX_DF, df  # MAX_DF: the df the power statement at SAMPLES covers
    assert p_values[False] > ALPHA, p_values
    assert p_values[True] < ALPHA, p_values


def test_sampled_decoding_is_reproducible_and_seeded(trained):
    from dflash_trainer.inference.sampling import SampledVerification

    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    prompt = trained["prompts"][0]
    for mode, budget in [("chain", 1), ("ddtree", 16)]:
        first = decoder.generate(prompt, 24, mode, budget, SampledVerification(1.0, 1.0, seed=7))
        again = decoder.generate(prompt, 24, mode, budget, SampledVerification(1.0, 1.0, seed=7))
        assert first.tokens == again.tokens and first.accepted == again.accepted
        others = {
            tuple(decoder.generate(prompt, 24, mode, budget, SampledVerification(1.0, 1.0, s)).tokens) for s in range(3)
        }
        assert len(others) > 1


def _visited_rounds(trained, mode, budget, temperature, top_p, seeds):
    """Real speculative sampling of the fixture's prompts: per run, the row of generated context
    (padded so every anchor has a full block) and its rounds' anchors and accepted counts."""
    from dflash_trainer.data.packing import PackedRow
    from dflash_trainer.inference.sampling import SampledVerification

    decoder = SpeculativeDecoder(trained["target"], trained["drafter"], EOS)
    b = block_span(trained["drafter"].spec)  # a block's row tokens (DSpark's sample_from_anchor: B + 1)
    runs = []
    for i, prompt in enumerate(trained["prompts"][:4]):
        prefilled = decoder.prefill(prompt)  # every seed decodes from a copy of one prefill
        for seed in seeds:
            policy = SampledVerification(temperature, top_p, 100 * i + seed)
            res = decoder.generate(prompt, 32, mode, budget, policy, prefilled)
            ids = torch.tensor(prompt + res.tokens + [EOS[0]] * b)
            row = PackedRow(ids, torch.arange(ids.numel()), torch.ones_like(ids))
            runs.append((row, torch.tensor(res.anchors), res.accepted))
    return runs


@pytest.mark.parametrize("mode, budget, temperature, top_p", [("chain", 1, 1.0, 1.0), ("ddtree", 8, 0.7, 0.9)])
def test_expected_acceptance_is_the_mean_of_measured_acceptance(trained, mode, budget, temperature, top_p):
    check_expected_acceptance(trained, mode, budget, temperature, top_p)


# The expected-acceptance check's control: the expectations at 2T (a flatter target accepts less), on the
# same rounds. Its z is the check's own z plus the shift s = (E_T - E_2T) / SE, and the two z's share the
# sampling noise, so s = z_control - z is read off nearly noise-free. The check (|z| < 4, z ~ N(0, 1))
# rejects the control's expectations with probability P(|N(0, 1) + s| > 4) >= CONTROL_POWER when
# |s| >= 4 + Phi^-1(CONTROL_POWER) = 6.33. s grows as sqrt(rounds); measured here (2026-12-03) at 6 seeds
# (4 prompts each): DDTree s = 9.4 (DFlash), 12.6 (DSpark), 8.9 (DFlash2), so the DDTree checks run 4 seeds
# (measured: 7.9, 10.7, 8.6); the chain at T = 1 only s = 5.2 (667 rounds). With the Muon-trained
# drafters (2026-12-04): DDTree s = 7.37 at 4 seeds, the chain s = 8.10 at 12 seeds (1288 rounds), so the
# chain check runs 10 seeds, s ~ 8.10 sqrt(10 / 12) = 7.4: the DDTree check's margin over 6.33.
CONTROL_POWER = 0.99
CONTROL_SHIFT = 4 + 2.3263  # 4 + the standard normal's 0.99 quantile


def check_expected_acceptance(trained, mode, budget, temperature, top_p, seeds=None):
    """At the very contexts real speculative sampling visited, eval's expected accepted count (exact
    target conditionals along the drafter's chain or tree) is the mean of the accepted count measured:
    mean(measured - expected) over the rounds is within 4 standard errors of 0. Expectations at the
    wrong temperature (2T) are rejected by the same check, with the power CONTROL_POWER states.
    ``seeds``: runs per prompt (default 10 for the chain, 4 for the tree; see CONTROL_SHIFT)."""
    from dflash_trainer.inference.sampled_acceptance import block_expectations_at

    target, drafter = trained["target"], trained["drafter"]
    seeds = seeds or (10 if mode == "chain" else 4)
    runs = _visited_rounds(trained, mode, budget, temperature, top_p, range(seeds))
    diffs = [[], []]  # measured - expected at T, and at 2T (one pass per run gives both)
    for row, anchors, accepted in runs:
        at = block_expectations_at(
            target, drafter, row, anchors, temperatures=[temperature, 2 * temperature], top_p=top_p, budgets=[budget]
        )
        for d, e in zip(diffs, at):
            expected = e["chain"] if mode == "chain" else e["ddtree"][:, 0]
            d += (torch.tensor(accepted, dtype=torch.float64) - expected).tolist()

    def z_score(diffs):
        d = torch.tensor(diffs)
        return (d.mean() / (d.std() / len(diffs) ** 0.5)).item()

    z, control, rounds = z_score(diffs[0]), z_score(diffs[1]), len(diffs[0])
    print(f"{rounds} rounds: z {z:.2f}; at 2T: z {control:.2f} (shift {control - z:.2f}, needed {CONTROL_SHIFT:.2f})")
    assert rounds > 100
    assert abs(z) < 4, z
    assert abs(control) > 4, control  # the wrong expectations fail the check
    assert abs(control - z) >= CONTROL_SHIFT, (control, z)  # and would fail it with CONTROL_POWER


def test_expectations_at_several_temperatures_are_each_temperatures_own(trained):
    """block_expectations_at shares one pass (drafts, trees, target logits) among temperatures: what it
    gives for each T is block_expectations at that T alone, bit for bit, chain and tree."""
    from dflash_trainer.data.packing import PackedRow
    from dflash_trainer.inference.sampled_acceptance import block_expectations, block_expectations_at

    ids = torch.tensor(trained["prompts"][0] + trained["prompts"][1])
    row = PackedRow(ids, torch.arange(ids.numel()), torch.ones_like(ids))
    anchors = torch.tensor([20, 40, 41, 70, 90])
    target, drafter = trained["target"], trained["drafter"]
    temperatures = [1.0, 0.3]
    kw = {"top_p": 0.9, "budgets": [2, 8], "max_logit_elements": 3 * 8192 * 12}  # several passes per document
    together = block_expectations_at(target, drafter, row, anchors, temperatures=temperatures, **kw)
    for t, got in zip(temperatures, together):
        alone = block_expectations(target, drafter, row, anchors, temperature=t, **kw)
        assert got.keys() == alone.keys() and all(torch.equal(got[k], alone[k]) for k in alone), t
    assert not torch.equal(together[0]["chain"], together[1]["chain"])  # the temperature really applies


def test_expected_equals_greedy_acceptance_as_temperature_vanishes(trained):
    """At T -> 0 the target's sampling distribution is its argmax, so the expected chain and DDTree
    acceptance equal the greedy teacher-forced acceptance of the same blocks."""
    from dflash_trainer.data.documents import Document
    from dflash_trainer.data.packing import pack_documents
    from dflash_trainer.inference.acceptance import acceptance_report
    from dflash_trainer.inference.sampled_acceptance import expected_sampled_acceptance

    tok = trained["tok"]
    docs = []
    for i, rec in enumerate(trained["records"][:4]):
        prompt = trained["prompts"][i]
        response = tok(rec["messages"][1]["content"], add_special_tokens=False)["input_ids"]
        docs.append(Document(prompt + response, [0] * len(prompt) + [1] * len(response), "mem", i))
    rows = pack_documents(docs, 512, 0)
    greedy = acceptance_report(
        trained["target"], trained["drafter"], rows, budgets=[4, 16], max_blocks_per_row=12, decode_path=False
    )
    cold = expected_sampled_acceptance(
        trained["target"], trained["drafter"], rows, temperature=1e-4, budgets=[4, 16], max_blocks_per_row=12
    )
    assert cold["blocks"] == greedy["blocks"]
    assert abs(cold["tau"] - greedy["tau"]) < 1e-6
    assert max(abs(a - b) for a, b in zip(cold["ddtree_tau"], greedy["ddtree_tau"])) < 1e-6
    warm = expected_sampled_acceptance(
        trained["target"], trained["drafter"], rows, temperature=1.0, budgets=[4, 16], max_blocks_per_row=12
    )
    assert warm["tau"] < cold["tau"]  # the records are the target's greedy responses
    assert warm["ddtree_tau"][0] <= warm["ddtree_tau"][1]
    # tau - 1 is the sum of the reach probabilities (each <= 1): both sides sums of at most B terms in float64
    b = trained["drafter"].spec.block_size
    assert abs(sum(warm["reach"]) - (warm["tau"] - 1)) <= 2 * tolerances.gamma(b + 1, torch.float64) * b


def test_cli_speculative_sampling(trained, tmp_path):
    """`speculate --temperature`: sampled outputs (not compared token for token), tau per mode, seeded."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in trained["records"][:2]))

    def speculate(out, *extra, process=True):
        return speculate_cli(trained, prompts, out, "--max-new-tokens", "16", *extra, process=process)

    out = tmp_path / "s.jsonl"
    result = speculate(  # in this process: speculate as a process is test_cli_reports_tau_speedup_and_agreement
        out, "--mode", "ddtree", "--budget", "8", "--temperature", "0.7", "--top-p", "0.9", "--seed", "5", process=False
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "s.jsonl.report.json").read_text())
    assert (report["temperature"], report["top_p"], report["seed"]) == (0.7, 0.9, 5)
    mode = report["modes"]["ddtree-8"]
    assert mode["mismatches"] is None and 1.0 <= mode["tau"] <= 8
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(r["ddtree-8_text"] for r in records)
    bad = speculate(tmp_path / "x.jsonl", "--temperature", "1", "--top-p", "1.5", process=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "dflash-train: error: --top-p must be in (0, 1], got 1.5"
    ]
