"""Run inside the separate speculators venv (tests/test_dspark_export.py makes it): load a DSpark
export with the ``speculators`` package's own ``DSparkDraftModel.from_pretrained`` and write its
Markov-corrected block logits and confidence logits.

    python speculators_dspark_logits.py EXPORT INPUTS OUTPUT

INPUTS safetensors: ``features`` [L, k*H] (float32 or float64: the dtype the model runs in, float64 with
float64_precision's raised precision), ``input_ids`` [L], ``anchors`` [n]. OUTPUT gets ``logits``
[n, B, V] (backbone logits + ``markov_head.block_bias`` of the ground-truth previous block tokens, as
``DSparkDraftModel.forward`` adds them in training) and ``confidence`` [n, B], in that dtype. Nothing from
dflash_trainer is imported here.
"""

import sys

import float64_precision  # noqa: F401  (before the model is built)
import torch
from safetensors.torch import load_file, save_file
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

export_dir, inputs_path, output_path = sys.argv[1:4]
config = DSparkSpeculatorConfig.from_pretrained(export_dir)
config.transformer_layer_config._attn_implementation = "eager"
inputs = load_file(inputs_path)
features, ids, anchors = inputs["features"], inputs["input_ids"].long(), inputs["anchors"].long()
model = DSparkDraftModel.from_pretrained(export_dir, config=config).to(features.dtype).eval()
length, n, block = ids.numel(), anchors.numel(), model.block_size
loss_mask = torch.zeros(1, length, dtype=torch.long)
loss_mask[0, anchors] = 1  # select_anchors picks exactly these anchors (max_anchors = n)
hidden_size = features.shape[-1] // len(config.aux_hidden_state_layer_ids)
with torch.no_grad():
    hidden, logits, _, _, block_idx = model._backbone_forward(
        features[None],
        ids[None],
        loss_mask,
        torch.zeros(1, length, hidden_size, dtype=features.dtype),
        torch.zeros(1, length, dtype=torch.long),
        torch.arange(length)[None],
        max_anchors=n,
    )
    tokens = ids[block_idx].view(n, block)  # what DSparkDraftModel.forward takes as block tokens
    prev = tokens if config.sample_from_anchor else torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)
    hidden_blocks = hidden.view(n, block, -1)
    prev_emb = model.markov_head.prev_embeddings(prev)
    bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden_blocks, prev_emb=prev_emb)
    logits = logits.view(n, block, -1) + bias
    feats = torch.cat([hidden_blocks, prev_emb], -1) if config.confidence_head_with_markov else hidden_blocks
    conf = model.confidence_head(feats)
save_file({"logits": logits.contiguous(), "confidence": conf.contiguous()}, output_path)
