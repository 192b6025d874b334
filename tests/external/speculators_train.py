"""Run inside the separate speculators venv: train a DFlash drafter with the ``speculators`` package's
own code (its training CLI's layer config, ``DFlashDraftModel.from_training_args``, its forward and
loss), save it with its ``save_pretrained``, reload it with its ``from_pretrained`` and count greedy
acceptance at given anchors with its own model code.

    python speculators_train.py JOB.json

JOB.json: ``{"verifier": DIR, "rows": FILE, "out": DIR, "result": FILE, "steps": int, "lr": float,
"block_size": int, "aux_ids": [int], "mask_token_id": int, "max_anchors": int, "seed": int}``.
ROWS holds, per packed row r (all rows of one length L): ``features`` [R, L, k*H] (the verifier's aux
hidden states), ``last_hidden`` [R, L, H] (its last layer's output before the final norm),
``input_ids``, ``loss_mask``, ``document_ids``, ``position_ids`` [R, L] and ``anchors`` [R, L] (1 at
the positions to score). RESULT gets ``accepted`` [N] (per scored block, the longest prefix of slots
1..B-1 whose draft argmax equals the verifier's greedy token) and ``tau`` [1] = mean(accepted + 1).
Nothing from dflash_trainer is imported here.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.train.cli import create_transformer_layer_config

job = json.load(open(sys.argv[1]))
torch.manual_seed(job["seed"])
rows = load_file(job["rows"])
n_rows = rows["input_ids"].shape[0]


def row(name, r):
    return rows[name][r : r + 1]


layer = create_transformer_layer_config(
    job["verifier"], num_layers=1, draft_arch="qwen3", hidden_act=None, sliding_window=0, full_attention_indices=[0]
)
model = DFlashDraftModel.from_training_args(
    verifier_config=layer,
    draft_vocab_size=layer.vocab_size,
    block_size=job["block_size"],
    target_layer_ids=job["aux_ids"],
    mask_token_id=job["mask_token_id"],
    verifier_name_or_path=job["verifier"],
    draft_attn_impl="eager",  # dense float masks: the CPU path of the same rule
)
train_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
train_kwargs["max_anchors"] = job["max_anchors"]
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(params, lr=job["lr"])
model.train()
for step in range(job["steps"]):
    r = step % n_rows
    _, loss, _ = model(
        row("features", r),
        row("input_ids", r),
        row("loss_mask", r),
        row("last_hidden", r),
        row("document_ids", r),
        row("position_ids", r),
        **train_kwargs,
    )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
model.save_pretrained(job["out"])

config = DFlashSpeculatorConfig.from_pretrained(job["out"])
config.transformer_layer_config._attn_implementation = "eager"
served = DFlashDraftModel.from_pretrained(job["out"], config=config).float().eval()
b, accepted = served.block_size, []
with torch.no_grad():
    for r in range(n_rows):
        n = int(rows["anchors"][r].sum())
        if n == 0:
            continue
        _, logits, targets, _, _ = served._backbone_forward(
            row("features", r),
            row("input_ids", r),
            row("anchors", r),  # select_anchors then picks exactly these (max_anchors = n)
            row("last_hidden", r),
            row("document_ids", r),
            row("position_ids", r),
            max_anchors=n,
        )
        draft = logits[0].argmax(-1).view(n, b)[:, 1:]
        greedy = targets[0].argmax(-1).view(n, b)[:, 1:]  # the verifier's greedy token at anchor + k
        accepted.append((draft == greedy).long().cumprod(1).sum(1))
accepted = torch.cat(accepted)
save_file({"accepted": accepted, "tau": (accepted.double() + 1).mean()[None]}, job["result"])
