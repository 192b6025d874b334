"""Run inside the separate z-lab venv (PyPI ``dflash``, z-lab's own package): write DFlash drafters with
z-lab's ``DFlashDraftModel(...).save_pretrained`` and compute block logits with its own forward.

    python zlab_drafter.py JOBS.json

Each job may hold "config" (Qwen3Config fields plus z-lab's: block_size, dflash_config, ...) and
"seed": build the model (its own initialization, norms drawn around 1) and save it to "out"; and
"inputs"/"output": load "out" with ``DFlashDraftModel.from_pretrained`` and write ``logits`` [n, B-1, V]
of the draft slots. INPUTS holds ``features`` [L, k*H] (the target's context features), ``input_ids``
[L], ``anchors`` [n], ``embed`` [V, H] and ``head`` [V, H] (the target's tables). The block is embedded
and its logits computed as z-lab's ``dflash_generate`` does. A failure writes ``error`` (utf-8 bytes).
Nothing from dflash_trainer is imported here.
"""

import json
import sys

import torch
from dflash import DFlashDraftModel
from dflash.model import _draft_value  # z-lab's own read of a field: dflash_config, then the top level
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config


def build(job):
    torch.manual_seed(job["seed"])
    model = DFlashDraftModel(Qwen3Config(**job["config"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.save_pretrained(job["out"])


def block_logits(job):
    model = DFlashDraftModel.from_pretrained(job["out"], dtype=torch.float32).eval()
    inputs = load_file(job["inputs"])
    feats, ids, embed = inputs["features"].float(), inputs["input_ids"].long(), inputs["embed"].float()
    head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False)
    head.weight.data = inputs["head"].float()
    scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
    b, out = model.block_size, []
    with torch.no_grad():
        for a in inputs["anchors"].tolist():
            block = torch.tensor([int(ids[a])] + [model.mask_token_id] * (b - 1))
            hidden = model(
                position_ids=torch.arange(a + b)[None],
                noise_embedding=(embed[block] * scale)[None],
                target_hidden=feats[:a][None],
            )
            out.append(model.compute_logits(hidden[0, 1:], head))
    return torch.stack(out).contiguous()


for job in json.load(open(sys.argv[1])):
    try:
        if "config" in job:
            build(job)
        if "inputs" in job:
            save_file({"logits": block_logits(job)}, job["output"])
    except Exception as exc:  # the test asserts on this text
        text = f"{type(exc).__name__}: {exc}".encode()[:4000]
        save_file({"error": torch.tensor(list(text), dtype=torch.uint8)}, job["output"])
