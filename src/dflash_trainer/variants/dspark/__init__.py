"""DSpark (DeepSeek, arXiv 2607.05147; speculators 0.9.0 ``models/dspark`` is the reference).

The DFlash backbone plus two small heads:

- a Markov head: a rank-r logit bias from the previous token of the block, ``bias = W2 @ f``, with
  ``f = W1[prev]`` (vanilla), ``sigmoid(gate([h, W1[prev]])) * W1[prev]`` (gated) or the output of a
  recurrent state over the block (rnn); ``W1`` ``[V, r]`` an embedding over the target vocabulary,
  ``W2`` ``[V, r]``. In the loss it is a rank-r term of the same logits, folded into the fused loss's
  chunked GEMM (``bias_rows = f``, ``bias_weight = W2``): never ``[N, V]``.
- a confidence head: ``sigmoid(Linear([h, W1[prev]]))``, the slot's predicted acceptance, trained
  with BCE against the measured acceptance ``a = sum_v min(p_v, q_v)`` (detached), weight
  ``confidence_alpha``.

Which slot predicts which token (``sample_from_anchor``, the DSpark default, true):

    block           [anchor = x_P, MASK, ..., MASK]           slots k = 0..B-1 at positions P + k
    true:   slot k predicts x_{P+k+1}, prev token x_{P+k}     (B drafts; slot 0 predicts too)
    false:  slot k predicts x_{P+k},   prev token x_{P+k-1}   (k >= 1: B - 1 drafts, as DFlash)

In training ``prev`` is the ground-truth token (teacher forcing); at inference it is the token just
drafted (``propose`` walks the block slot by slot: one drafter pass, only the heads walk).

The package: ``settings`` (the ``drafter.dspark`` section), ``modules`` (the two heads), ``objective``
(the loss), ``drafting`` (the Markov walk, DDTree expansion), ``formats`` (speculators' layout),
``cost`` (the planner's figures); ``variant`` puts them together.
"""
