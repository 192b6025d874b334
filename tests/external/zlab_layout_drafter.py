"""Run inside a separate venv that has a z-lab-layout writer: z-lab's own package (PyPI ``dflash``) or
SpecForge (PyPI ``specforge``, whose ``DFlashDraftModel`` writes the same layout). Writes DFlash drafters
with the writer's ``DFlashDraftModel(...).save_pretrained`` and computes block logits with its own
forward.

    python zlab_layout_drafter.py JOBS.json

Each job names "class" (``module:Class``, the writer's DFlashDraftModel) and may hold "config"
(Qwen3Config fields plus the layout's: block_size, dflash_config, ...) and "seed": build the model (its
own initialization, norms drawn around 1) and save it to "out"; and "inputs"/"output": load "out" with
the class's ``from_pretrained`` and write ``logits`` [n, B-1, V] of the draft slots. INPUTS holds
``features`` [L, k*H] (the target's context features), ``input_ids`` [L], ``anchors`` [n], ``embed``
[V, H] and ``head`` [V, H] (the target's tables), all in the dtype the model runs in (float32, or
float64 with float64_precision's raised precision). The block is embedded and its logits computed as the
writer's decoding loop does (z-lab's ``dflash_generate``: ``compute_logits`` and
``input_embedding_scale``; SpecForge's ``spec_generate``: the target's head). A failure writes
``error`` (utf-8 bytes). Nothing from dflash_trainer is imported here.
"""

import importlib
import json
import sys

import float64_precision  # noqa: F401  (before the model is built)
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config


def writer(job):
    module, name = job["class"].split(":")
    return importlib.import_module(module), getattr(importlib.import_module(module), name)


def build(job):
    torch.manual_seed(job["seed"])
    model = writer(job)[1](Qwen3Config(**job["config"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.save_pretrained(job["out"])


def block_logits(job):
    module, cls = writer(job)
    inputs = load_file(job["inputs"])
    feats, ids, embed = inputs["features"], inputs["input_ids"].long(), inputs["embed"]  # the dtype to run in
    model = cls.from_pretrained(job["out"], dtype=feats.dtype).eval()
    head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False, dtype=feats.dtype)
    head.weight.data = inputs["head"]
    # z-lab reads a field from dflash_config, then the top level; SpecForge has no embedding scale
    draft_value = getattr(module, "_draft_value", None)
    scale = float(draft_value(model.config, "input_embedding_scale", 1.0)) if draft_value else 1.0
    b, out = model.block_size, []
    with torch.no_grad():
        for a in inputs["anchors"].tolist():
            block = torch.tensor([int(ids[a])] + [model.mask_token_id] * (b - 1))
            hidden = model(
                position_ids=torch.arange(a + b)[None],
                noise_embedding=(embed[block] * scale)[None],
                target_hidden=feats[:a][None],
            )
            hidden = hidden[0, 1:]
            out.append(model.compute_logits(hidden, head) if hasattr(model, "compute_logits") else head(hidden))
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
