"""Run inside the separate venv of z-lab's package (PyPI ``dflash`` 0.1.0; tests/test_dflash2_export.py
makes it): load a DFlash2 zlab export with z-lab's own ``DFlash2DraftModel.from_pretrained`` and write
the tokens its ``propose`` selects at temperature 0, each block drafted as ``dflash_generate`` drafts it.

    python zlab_dflash2_propose.py EXPORT INPUTS OUTPUT

INPUTS safetensors: ``features`` [L, k*H] (the target's ``hidden_states[l + 1]`` at z-lab's layer ids,
as z-lab's ``extract_context_feature`` takes them), ``input_ids`` [L], ``anchors`` [n], ``embed`` [V, H]
and ``head`` [V, H] (the target's tables), in the dtype the model runs in (float32, or float64 with
float64_precision's raised precision). OUTPUT gets ``logits`` [n, B-1, V] (``compute_logits`` of
the draft slots), ``tokens`` [n, B-1] (``propose``'s selection), or ``error`` (utf-8 bytes) when a
weight is not loaded. Nothing from dflash_trainer is imported here.
"""

import sys

import float64_precision  # noqa: F401  (before the model is built)
import torch
from dflash import DFlash2DraftModel
from safetensors.torch import load_file, save_file

export_dir, inputs_path, output_path = sys.argv[1:4]
inputs = load_file(inputs_path)
feats, ids, embed = inputs["features"], inputs["input_ids"].long(), inputs["embed"]
model, info = DFlash2DraftModel.from_pretrained(export_dir, dtype=feats.dtype, output_loading_info=True)
if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
    text = f"loading: {info}".encode()[:4000]
    save_file({"error": torch.tensor(list(text), dtype=torch.uint8)}, output_path)
    sys.exit(0)
model.eval()
head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False, dtype=feats.dtype)
head.weight.data = inputs["head"]
b, logits, tokens = model.block_size, [], []
with torch.no_grad():
    for a in inputs["anchors"].tolist():
        block = torch.tensor([int(ids[a])] + [model.mask_token_id] * (b - 1))
        hidden = model(
            position_ids=torch.arange(a + b)[None],
            noise_embedding=embed[block][None],
            target_hidden=feats[:a][None],
        )[:, 1:]  # the draft slots, as dflash_generate slices them
        drafts, _, _ = model.propose(hidden, ids[a : a + 1], head, 0.0)
        logits.append(model.compute_logits(hidden, head)[0])
        tokens.append(drafts[0])
save_file({"logits": torch.stack(logits).contiguous(), "tokens": torch.stack(tokens).contiguous()}, output_path)
