"""What the draft loss computes: one typed object, validated once, on construction.

``LossTerms`` holds the base terms (CE blended with soft KL at a temperature, CAP, the label source,
the target's logit transform) and the pluggable ones:

- ``pair_terms``: per-row terms of one *pair statistic* of the student p and the teacher q at T = 1.
  Every implementation's row pass computes both statistics, so a term is data, not code, and the
  kernels never learn which variant asked for it:

      overlap     a = sum_v min(p_v, q_v)             (the acceptance of a sampled draft; 1 - TV)
      renyi_half  d = -2 log sum_v sqrt(p_v q_v)      (the Renyi divergence of order 1/2)
      reverse_kl  r = sum_v p_v log(p_v / q_v)        (KL(p || q): mode-seeking, the on-policy stage's)

  A term's value per row is ``offset + scale * statistic``; its ``weight`` adds ``weight * value`` to
  the row's loss, weighted like CE (0: a metric only). The native and Triton kernels apply the
  gradient of ``renyi_half`` terms in their row pass; a weighted ``overlap`` term (its gradient needs
  the mask ``p < q``) and any ``reverse_kl`` term (the kernels do not compute it) run the eager passes,
  which implement all three.
- ``base_weight``: the weight of the CE/KL blend itself (1 by default; 0 leaves the pair terms and CAP
  alone: the on-policy stage's rejected rows, whose loss is a reverse KL only).
- ``credit``: a block credit that replaces the rows' weights (``BlockCredit``: D-PACE from the
  student's label probability, D-PARD from the overlap).
- ``top_k``: each row's K largest student logits and their ids, selected inside the chunk loop.

A variant builds its terms from its settings (DSpark: acceptance, Renyi-1/2, D-PARD; DFlash2: top K);
nothing under ``loss/`` names a variant.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Literal

STATISTICS = ("overlap", "renyi_half", "reverse_kl")
Statistic = Literal["overlap", "renyi_half", "reverse_kl"]
CONFIDENCES = ("label_prob", "overlap")


def _check(name: str, ok: bool, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"LossTerms: {name} must be {expected}, got {got!r}")


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # x == x: not NaN


@dataclass(frozen=True)
class PairTerm:
    """A per-row term ``offset + scale * statistic`` of the student and teacher distributions at T = 1
    (module docstring), reported as metric ``name`` (its mean over rows, and per slot), added to the
    row's loss with ``weight``."""

    name: str
    statistic: Statistic
    weight: float = 0.0
    scale: float = 1.0
    offset: float = 0.0

    def __post_init__(self):
        _check(
            "a pair term's name", isinstance(self.name, str) and self.name.isidentifier(), "an identifier", self.name
        )
        _check(
            f"pair term {self.name}'s statistic", self.statistic in STATISTICS, f"one of {STATISTICS}", self.statistic
        )
        _check(
            f"pair term {self.name}'s weight", _number(self.weight) and self.weight >= 0, "a number >= 0", self.weight
        )
        for key in ("scale", "offset"):
            value = getattr(self, key)
            _check(f"pair term {self.name}'s {key}", _number(value) and abs(value) != float("inf"), "finite", value)


@dataclass(frozen=True)
class BlockCredit:
    """Detached block credit in place of the rows' weights (which then only select the rows with loss):
    ``s_i = alpha + (1 - alpha) x_i`` with ``x_i`` the row's ``confidence`` ("label_prob": the student's
    p(y_i), D-PACE; "overlap": the overlap a_i, D-PARD); a row t gets ``W_t = sum_{k >= t} prod_{i <= k}
    s_i`` over its block's rows with loss, over the rows with loss in all (speculators' normalization).
    Needs the call's ``block_ids``."""

    confidence: Literal["label_prob", "overlap"]
    alpha: float = 0.5

    def __post_init__(self):
        _check("credit.confidence", self.confidence in CONFIDENCES, f"one of {CONFIDENCES}", self.confidence)
        _check("credit.alpha", _number(self.alpha) and 0.0 < self.alpha <= 1.0, "in (0, 1]", self.alpha)


@dataclass(frozen=True)
class LossTerms:
    """The draft loss's terms (shared/DESIGN.md section 3), validated on construction:

    ``L = sum_i c_i [b ((1-a) CE_i + a T^2 KL(q_i^T || p_i^T)) + sum_terms weight * value_i] + cap_weight * CAP``

    with ``c_i = w_i / sum w`` (or the block credit), ``b = base_weight``, ``a = kl_weight``,
    ``T = temperature``; CAP the mean
    entropy of softmax(z / cap_temperature) over rows whose argmax equals the label. ``label_source``
    "teacher" takes the teacher's argmax as the label; ``logit_scale`` and ``softcap`` are the target's
    logit transform (``loss.logits.transform_logits``)."""

    kl_weight: float = 0.0
    temperature: float = 1.0
    base_weight: float = 1.0
    cap_weight: float = 0.0
    cap_temperature: float = 1.0
    label_source: Literal["data", "teacher"] = "data"
    logit_scale: float = 1.0
    softcap: float | None = None
    pair_terms: tuple[PairTerm, ...] = ()
    credit: BlockCredit | None = None
    top_k: int = 0

    def __post_init__(self):
        _check("label_source", self.label_source in ("data", "teacher"), "'data' or 'teacher'", self.label_source)
        _check("kl_weight", _number(self.kl_weight) and 0.0 <= self.kl_weight <= 1.0, "in [0, 1]", self.kl_weight)
        _check(
            "base_weight", _number(self.base_weight) and 0.0 <= self.base_weight <= 1.0, "in [0, 1]", self.base_weight
        )
        _check("temperature", _number(self.temperature) and self.temperature > 0, "> 0", self.temperature)
        _check(
            "cap_temperature", _number(self.cap_temperature) and self.cap_temperature > 0, "> 0", self.cap_temperature
        )
        _check("cap_weight", _number(self.cap_weight) and self.cap_weight >= 0, ">= 0", self.cap_weight)
        _check("logit_scale", _number(self.logit_scale) and self.logit_scale != 0, "a nonzero number", self.logit_scale)
        _check(
            "softcap", self.softcap is None or (_number(self.softcap) and self.softcap > 0), "None or > 0", self.softcap
        )
        _check(
            "top_k",
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
            "an int >= 0",
            self.top_k,
        )
        terms = tuple(self.pair_terms)
        object.__setattr__(self, "pair_terms", terms)  # a list given is kept as a tuple (hashable, frozen)
        _check("pair_terms", all(isinstance(t, PairTerm) for t in terms), "PairTerm objects", terms)
        names = [t.name for t in terms]
        _check("pair term names", len(set(names)) == len(names), "distinct", names)
        _check(
            "credit", self.credit is None or isinstance(self.credit, BlockCredit), "a BlockCredit or None", self.credit
        )

    @property
    def pair_statistics(self) -> bool:
        """Whether the row pass computes the pair statistics (they need the teacher)."""
        return bool(self.pair_terms) or (self.credit is not None and self.credit.confidence == "overlap")

    @property
    def needs_teacher(self) -> bool:
        return self.kl_weight > 0 or self.label_source == "teacher" or self.pair_statistics

    def gradient_weight(self, statistic: Statistic) -> float:
        """``sum weight * scale`` over the weighted terms of ``statistic``: the factor of its gradient."""
        return sum(t.weight * t.scale for t in self.pair_terms if t.statistic == statistic and t.weight > 0)

    @property
    def reverse_kl(self) -> bool:
        """Whether the row pass computes the reverse KL (a ``reverse_kl`` term, weighted or a metric)."""
        return any(t.statistic == "reverse_kl" for t in self.pair_terms)

    @property
    def kernel_ready(self) -> bool:
        """Whether the native and Triton kernels compute everything: no weighted overlap term, no
        reverse KL, the whole CE/KL blend (``base_weight`` 1), and the ``renyi_half`` terms' gradient
        weight not negative (the kernels take a weight >= 0)."""
        overlap = any(t.weight > 0 and t.statistic == "overlap" for t in self.pair_terms)
        plain = not overlap and not self.reverse_kl and self.base_weight == 1.0
        return plain and self.gradient_weight("renyi_half") >= 0

    def to_json(self) -> str:
        """The terms as a string: what the custom op takes (its schema holds no dataclasses)."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> LossTerms:
        return _from_json(text)


@lru_cache(maxsize=64)
def _from_json(text: str) -> LossTerms:
    d = json.loads(text)
    d["pair_terms"] = tuple(PairTerm(**t) for t in d["pair_terms"])
    d["credit"] = BlockCredit(**d["credit"]) if d["credit"] is not None else None
    return LossTerms(**d)
