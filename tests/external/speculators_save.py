"""Run inside the separate speculators venv: write DFlash drafters with the ``speculators`` package's
own ``DFlashDraftModel(...).save_pretrained`` (what a drafter trained with speculators looks like).

    python speculators_save.py JOBS.json

JOBS.json: a list of ``{"out": DIR, "verifier": DIR, "seed": int, "layer": {Qwen3Config fields},
"dflash": {DFlashSpeculatorConfig fields: aux_hidden_state_layer_ids, mask_token_id, block_size, ...}}``.
The weights are the package's own initialization with ``initializer_range`` from "layer" (seeded), then
every norm weight drawn around 1 so that norms are not identities. Nothing from dflash_trainer is
imported here.
"""

import json
import sys

import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig, Qwen3Config

for job in json.load(open(sys.argv[1])):
    torch.manual_seed(job["seed"])
    layer = Qwen3Config(**job["layer"])
    layer._attn_implementation = "eager"
    block = job["dflash"].get("block_size", 8)
    verifier = AutoConfig.from_pretrained(job["verifier"])
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=layer.vocab_size,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_config(verifier, name_or_path=job["verifier"]),
        ),
        **job["dflash"],
    )
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.save_pretrained(job["out"])
