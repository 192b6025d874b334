"""Run inside the separate speculators venv (tests/test_dflash2_export.py makes it): load a DFlash2
export with the ``speculators`` package's own ``DFlash2DraftModel.from_pretrained`` and write its block
unary logits and the tokens its ``CandidateSelector.select`` picks, walking each block from its anchor.

    python speculators_dflash2_select.py EXPORT INPUTS OUTPUT

INPUTS safetensors: ``features`` [L, k*H] (float32 or float64: the dtype the model runs in, float64 with
float64_precision's raised precision), ``input_ids`` [L], ``anchors`` [n]. OUTPUT gets ``logits``
[n, B, V] (the anchored-block forward's unary logits, in that dtype), ``tokens`` [n, B-1] (slot k's choice
among its unary top K, the predecessor being the anchor for slot 1, else slot k-1's choice) and
``scores`` [n, B-1, K] (the selector's scores of each slot's candidates, in ``select``'s order), or
``error`` (utf-8 bytes) when loading leaves a weight missing. Nothing from dflash_trainer is imported.
"""

import sys

import float64_precision  # noqa: F401  (before the model is built)
import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

export_dir, inputs_path, output_path = sys.argv[1:4]
config = DFlash2SpeculatorConfig.from_pretrained(export_dir)
config.transformer_layer_config._attn_implementation = "eager"  # the CPU path of the same mask rule
model, info = DFlash2DraftModel.from_pretrained(export_dir, config=config, output_loading_info=True)
inputs = load_file(inputs_path)
features, ids, anchors = inputs["features"], inputs["input_ids"].long(), inputs["anchors"].long()
model = model.to(features.dtype).eval()  # the inputs' dtype: float32, or float64 with raised precision
missing = sorted(set(info["missing_keys"]) - {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"})
if missing or info["unexpected_keys"]:
    text = f"missing {missing}, unexpected {sorted(info['unexpected_keys'])}".encode()
    save_file({"error": torch.tensor(list(text), dtype=torch.uint8)}, output_path)
    sys.exit(0)
length, n, block = ids.numel(), anchors.numel(), model.block_size
loss_mask = torch.zeros(1, length, dtype=torch.long)
loss_mask[0, anchors] = 1  # select_anchors picks exactly these anchors (max_anchors = n)
hidden_size = features.shape[-1] // len(config.aux_hidden_state_layer_ids)
with torch.no_grad():
    hidden, logits, _, _, _ = model._backbone_forward(
        features[None],
        ids[None],
        loss_mask,
        # the verifier's last hidden state: only for training targets
        torch.zeros(1, length, hidden_size, dtype=features.dtype),
        torch.zeros(1, length, dtype=torch.long),  # one document
        torch.arange(length)[None],
        max_anchors=n,
    )
    hidden, logits = hidden.view(n, block, -1), logits.view(n, block, -1)
    prev, tokens, scores = ids[anchors], [], []
    for k in range(1, block):  # select re-scores one slot given the predecessor passed: walk slot by slot
        candidates, slot_scores = model.candidate_selector.select(logits[:, k], hidden[:, k], prev)
        prev = candidates.gather(-1, slot_scores.argmax(-1, keepdim=True)).squeeze(-1)
        tokens.append(prev)
        scores.append(slot_scores)
save_file(
    {
        "logits": logits.contiguous(),
        "tokens": torch.stack(tokens, 1).contiguous(),
        "scores": torch.stack(scores, 1).contiguous(),
    },
    output_path,
)
