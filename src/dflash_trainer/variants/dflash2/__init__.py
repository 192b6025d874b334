"""DFlash2 (z-lab: the ``dflash`` package 0.1.0's ``DFlash2DraftModel``; speculators 0.9.0 ``models/dflash2``).

The DFlash backbone plus two pieces:

- **Local convolutions.** Around attention and around the MLP of every layer, a grouped dynamic
  causal convolution over the slots of a block (``GroupedDynamicCausalConv``): the sublayer's input
  ``x`` ``[T, H]`` becomes ``sum_t x[j - t] * (base_in[t] + dyn_in[j, t])`` and its output ``y``
  becomes ``sum_t y[j - t] * (base_out[t] + dyn_out[j, t])``, taps ``t < kernel``; ``base`` ``[2,
  kernel, H]`` is learned per channel, ``dyn`` ``[T, 2, kernel, H / group]`` is projected from the
  sublayer's input and shared by each group of ``group`` channels. The base kernel starts as the
  identity (tap 0 = 1) and the projection at zero, so an untrained DFlash2 computes exactly DFlash.
  A tap never reaches across a block boundary: the rows are viewed as ``[nb, B, H]`` and shifted
  inside each block, so the training layout (many blocks flattened into one dimension) equals the
  serving layout (one block) slot for slot.
- **Candidate selector** (``CandidateSelector``). The unary logits (the target's head over the
  drafter's hidden state, with its logit transform) pick the top K candidates of a slot; candidate
  ``c`` after predecessor ``t`` scores ``unary(c) + <pred[t] * (P h), succ[c]>`` (codebooks ``pred``,
  ``succ`` ``[V, r]``, ``P`` ``[r, H]``). At inference the walk starts at the anchor and each slot's
  predecessor is the token selected at the slot before: one drafter pass per block, only the
  selector walks. The draft distribution of a slot is the softmax of its K scores (zero elsewhere).

Slots as in DFlash: slot k of ``[anchor, MASK x (B-1)]`` predicts the token at ``anchor + k``
(k >= 1); its predecessor is the token at ``anchor + k - 1`` (the ground truth in training).

Training (speculators' split objective): the configured DFlash loss on the unary logits plus
``selector_alpha`` x a K-way cross-entropy over the unary top K, the label's position among them as
the class; where the label is not among the top K it replaces the weakest candidate. The top K come
out of the fused loss's chunk loop (``top_k``): the selector only ever sees ``[N, K]``.

The package: ``settings`` (the ``drafter.dflash2`` section), ``modules`` (the convolution and the
selector), ``objective`` (the loss), ``drafting`` (the selector walk, DDTree expansion), ``formats``
(z-lab's and speculators' layouts), ``cost`` (the planner's figures); ``variant`` puts them together.
"""
