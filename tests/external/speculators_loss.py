"""Run inside the separate speculators venv (tests/test_loss_recipe.py makes it): speculators' own DFlash
loss functions on given logits, D-PACE's position weights and the total-variation term.

    python speculators_loss.py INPUTS OUTPUT BLOCK ALPHA

INPUTS safetensors: ``logits`` [T, V] (the student's, float64), ``targets`` [T, V] (the teacher's logits;
speculators' CE takes their argmax as labels) and ``loss_mask`` [T] (0 at each block's anchor slot and
at positions without loss), T a multiple of BLOCK. OUTPUT gets ``dpace``: ``loss_function`` with
eager CE and ``dpace_loss_decay`` (the loss speculators trains with ``per_position_loss_weight:
dpace``), and ``tv``: ``loss_function`` with eager TV and no decay (the masked mean of 1 - sum min(p, q),
computed by speculators in float32). Nothing from dflash_trainer is imported here.
"""

import sys
from functools import partial

import torch
from safetensors.torch import load_file, save_file
from speculators.losses import eager
from speculators.losses.utils import dpace_loss_decay, loss_function

inputs_path, output_path, block, alpha = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
inputs = load_file(inputs_path)
logits, targets, mask = inputs["logits"][None], inputs["targets"][None], inputs["loss_mask"][None]
pos_idx = torch.arange(logits.shape[1])[None] % block
decay = partial(dpace_loss_decay, loss_mask=mask, block_size=block, dpace_alpha=alpha)
dpace = loss_function(logits, targets, mask, pos_idx, loss_fn=eager.ce_loss, decay_fn=decay)
tv = loss_function(logits, targets, mask, pos_idx, loss_fn=eager.tv_loss, decay_fn=None)
save_file({"dpace": dpace.reshape(1).double(), "tv": tv.reshape(1).double()}, output_path)
