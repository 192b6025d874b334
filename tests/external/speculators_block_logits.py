"""Run inside the separate speculators venv (tests/test_serving_parity.py makes it): load exports with
the ``speculators`` package's own ``DFlashDraftModel.from_pretrained`` and write their block logits.

    python speculators_block_logits.py JOBS.json

JOBS.json: a list of ``{"export": DIR, "inputs": FILE, "output": FILE}`` (a job without "inputs" writes
the loaded model's ``embed_tokens`` [V, H] float32 as ``embed`` instead). Each INPUTS safetensors holds
``features`` [L, k*H] (the verifier's aux hidden states, float32 or float64: the dtype the model runs
in, float64 with float64_precision's raised precision), ``input_ids`` [L] and ``anchors`` [n] (each <
L - block_size). Each OUTPUT gets ``logits`` [n, B, V] (in that dtype) from speculators'
anchored-block forward (its own masks, windows and causal-in-block rule), or ``error`` (utf-8 bytes)
when ``from_pretrained`` fails. Nothing from dflash_trainer is imported here.
"""

import json
import sys

import float64_precision  # noqa: F401  (before the model is built)
import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig


def block_logits(export_dir: str, inputs: dict) -> torch.Tensor:
    config = DFlashSpeculatorConfig.from_pretrained(export_dir)
    # Dense float masks and eager attention: the CPU path of the same mask rule (flex needs torch.compile).
    config.transformer_layer_config._attn_implementation = "eager"
    features, ids, anchors = inputs["features"], inputs["input_ids"].long(), inputs["anchors"].long()
    model = DFlashDraftModel.from_pretrained(export_dir, config=config).to(features.dtype).eval()
    length, n = ids.numel(), anchors.numel()
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, anchors] = 1  # select_anchors then picks exactly these anchors (max_anchors = n)
    hidden = features.shape[-1] // len(config.aux_hidden_state_layer_ids)
    with torch.no_grad():
        _, logits, _, _, _ = model._backbone_forward(
            features[None],
            ids[None],
            loss_mask,
            # the verifier's last hidden state: only for training targets
            torch.zeros(1, length, hidden, dtype=features.dtype),
            torch.zeros(1, length, dtype=torch.long),  # one document
            torch.arange(length)[None],
            max_anchors=n,
        )
    return logits[0].reshape(n, model.block_size, -1).contiguous()


def embed_table(export_dir: str) -> torch.Tensor:
    model = DFlashDraftModel.from_pretrained(export_dir)
    return model.embed_tokens.weight.detach().float().contiguous()


for job in json.load(open(sys.argv[1])):
    try:
        if "inputs" in job:
            result = {"logits": block_logits(job["export"], load_file(job["inputs"]))}
        else:
            result = {"embed": embed_table(job["export"])}
    except Exception as exc:  # the test asserts on this text
        text = f"{type(exc).__name__}: {exc}".encode()[:4000]
        result = {"error": torch.tensor(list(text), dtype=torch.uint8)}
    save_file(result, job["output"])
