"""Drafters for the vLLM parity checks (tests/test_vllm_serving.py, benchmarks/bench_vllm.py), our own
greedy and speculative decoding of their prompts, and vLLM run on their exports
(``dflash_trainer.serving.launch``) from its own venv (``external_venvs.vllm_python``).

tau, on both sides, is the mean number of tokens one target verification step emits: the accepted
drafts plus the target's own next token. ``dflash-train speculate`` reports it that way
(``SpeculativeDecoder``: sum of (accepted + 1) over rounds / rounds); vLLM counts accepted drafts per
draft step (``vllm:spec_decode_num_accepted_tokens`` / ``vllm:spec_decode_num_drafts``), so its tau is
``1 + accepted / drafts``. Both count the verification steps of a request (the prefill's token is
no step) with every draft the target accepted in it, before the output is cut at ``max_tokens``; the
tests read ours from one teacher-forced pass (``decode_path_tau``: speculate's rounds, round for round,
without each prompt's last few), ``our_decoding`` decodes for real (the benchmark's figures).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from trained import greedy_batch, held_out_prompts

from dflash_trainer.config import load_config
from dflash_trainer.data.documents import Document
from dflash_trainer.data.packing import pack_documents
from dflash_trainer.drafter_folder import load_drafter, save_drafter
from dflash_trainer.export.formats import export_checkpoint
from dflash_trainer.inference.acceptance import decode_path_acceptance
from dflash_trainer.inference.speculative import SpeculativeDecoder
from dflash_trainer.model.target import TargetModel
from dflash_trainer.serving.launch import run_vllm as serving_run
from dflash_trainer.serving.launch import vllm_env, vllm_tau  # noqa: F401  (the tests' and benchmark's)
from dflash_trainer.tiny_target import load_tiny_target, tiny_target_path
from dflash_trainer.training.setup import prepare
from dflash_trainer.training.trainer import Trainer
from dflash_trainer.variants import make_drafter

EOS = [0, 2]  # the tiny target's generation config: <|endoftext|>, <|im_end|>
LAST_LAYER_IDS = [1, 2, 3, 5, 7]  # 7: the 8-layer tiny target's last layer (five features, as the defaults)
# setting -> (spec changes of the trained default drafter, formats vLLM serves it in: zlab refuses
# windows and a hooked last layer at export)
SETTINGS = {
    "defaults": ({}, ["speculators", "zlab"]),
    "windows": ({"sliding_window_layers": (0, 1), "sliding_window": 16}, ["speculators"]),
    "windows-causal-in-block": (
        {"sliding_window_layers": (0, 1), "sliding_window": 16, "causal_in_block_sliding": True},
        ["speculators"],
    ),
    "last-layer": ({}, ["speculators"]),  # hooks LAST_LAYER_IDS, fine-tuned from the defaults
    # drafter.rope_scaling: YaRN over an original context shorter than the prompts (about 200-330 positions)
    "yarn": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
        ["speculators"],
    ),
}


def chat_records(limit: int, new_tokens: int, answer_from: int = 0) -> tuple[list[dict], list[list[int]]]:
    """``limit`` chat records continuing held-out modules, answered by the target's own greedy output,
    and their prompt token ids (the chat template applied with the generation prompt). Records before
    ``answer_from`` are held-out prompts only: their assistant turn is left empty (no generation)."""
    model, tok = load_tiny_target()
    users, prompts = held_out_prompts(tok, limit)
    answers = [[] for _ in prompts[:answer_from]] + greedy_batch(model, prompts[answer_from:], new_tokens)
    records = [
        {
            "messages": [
                {"role": "user", "content": u},
                {"role": "assistant", "content": tok.decode(a, skip_special_tokens=True)},
            ]
        }
        for u, a in zip(users, answers)
    ]
    return records, prompts


def train_drafter(root: Path, data: Path, name: str, steps: int, overrides=(), init: Path | None = None) -> Path:
    """A tiny-demo drafter trained ``steps`` steps on ``data`` (from ``init``'s weights when given)."""
    cfg = load_config(
        ["tiny-demo"],
        [
            f"data.train_files=[{data}]",
            f"output_dir={root / name}",
            f"train.max_steps={steps}",
            f"train.eval_every={steps}",
            f"train.save_every={steps}",
            "data.max_eval_rows=1",
            "train.lr=3e-3",
            *overrides,
        ],
    )
    target, tok, rows, eval_rows, _ = prepare(cfg)
    trainer = Trainer(cfg, target, tok, rows, eval_rows, out_dir=root / name, target_path="tiny", progress=False)
    if init is not None:
        trainer.drafter.load_state_dict(load_drafter(init, TargetModel(target.model))[0].state_dict())
    trainer.fit()
    return save_drafter(trainer.drafter, root / f"ckpt-{name}", target=target, target_path="tiny")


def respecified(ckpt: Path, out: Path, **changes) -> Path:
    """``ckpt``'s weights under a spec with ``changes`` (attention settings that add no weights)."""
    model, _ = load_tiny_target()
    target = TargetModel(model)
    drafter, _ = load_drafter(ckpt, target)
    other = make_drafter(replace(drafter.spec, **changes), target.embed_tokens, target.lm_head_weight)
    other.load_state_dict(drafter.state_dict())
    return save_drafter(other, out, target=target, target_path="tiny")


def setting_checkpoints(
    root: Path, data: Path, steps: int, last_layer_steps: int, defaults: Path | None = None
) -> dict[str, Path]:
    """One checkpoint per ``SETTINGS`` entry: the defaults trained ``steps`` steps on ``data`` (or the
    checkpoint ``defaults``, trained so), the window settings on its weights, the last-layer drafter
    fine-tuned from it ``last_layer_steps`` steps."""
    ckpts = {"defaults": defaults or train_drafter(root, data, "defaults", steps)}
    for name, (changes, _) in SETTINGS.items():
        if changes:
            ckpts[name] = respecified(ckpts["defaults"], root / f"ckpt-{name}", **changes)
    ckpts["last-layer"] = train_drafter(
        root, data, "last-layer", last_layer_steps, [f"target.layer_ids={LAST_LAYER_IDS}"], init=ckpts["defaults"]
    )
    return ckpts


def export_all(root: Path, ckpts: dict[str, Path], allow_mismatch: bool = False) -> dict[str, Path]:
    """``{"FORMAT-SETTING": export folder}`` for every setting in each format vLLM serves it in."""
    model, _ = load_tiny_target()
    return {
        f"{fmt}-{name}": export_checkpoint(
            ckpts[name], root / f"{fmt}-{name}", fmt, target_model=model, allow_mismatch=allow_mismatch
        )
        for name, (_, formats) in SETTINGS.items()
        if name in ckpts
        for fmt in formats
    }


def on_tiny_target(ckpt: Path) -> tuple[TargetModel, object]:
    """``(the tiny target hooked at the checkpoint's layer ids, its drafter in eval mode)``."""
    model, _ = load_tiny_target()
    meta = json.loads((ckpt / "drafter_config.json").read_text())
    target = TargetModel(model, layer_ids=meta["target"]["layer_ids"])
    return target, load_drafter(ckpt, target)[0].eval()


def our_decoding(ckpt: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    """What ``dflash-train speculate`` measures for ``ckpt`` on ``prompts``: chain-decoded tokens and
    the rounds and accepted drafts of every verification step."""
    target, drafter = on_tiny_target(ckpt)
    decoder = SpeculativeDecoder(target, drafter, EOS)
    tokens, rounds, accepted, squares = [], 0, 0, 0
    with torch.no_grad():
        for ids in prompts:
            res = decoder.generate(ids, max_tokens)
            tokens.append(res.tokens)
            rounds += len(res.accepted)
            accepted += sum(res.accepted)
            squares += sum((a + 1) ** 2 for a in res.accepted)
    tau = 1 + accepted / rounds
    return {"tokens": tokens, "rounds": rounds, "accepted": accepted, "tau": tau, "var": squares / rounds - tau**2}


def decode_path_tau(ckpt: Path, prompts: list[list[int]], greedy: list[list[int]]) -> dict:
    """``dflash-train speculate``'s chain tau for ``ckpt`` on ``prompts``, from one teacher-forced pass
    over the target's greedy continuations ``greedy`` instead of a decode per prompt: eval's decode-path
    walk (``inference.acceptance.decode_path_acceptance``), which visits speculate's rounds and counts
    their accepted drafts exactly, round for round (test_speculative.py::
    test_generate_chain_tau_agrees_with_eval_decode_tau), except each prompt's last rounds, whose block
    would run past the response (about 4 of each prompt's ~85). ``{"tau", "rounds", "var"}``."""
    target, drafter = on_tiny_target(ckpt)
    docs = [Document(p + g, [0] * len(p) + [1] * len(g), "greedy", i) for i, (p, g) in enumerate(zip(prompts, greedy))]
    rows = pack_documents(docs, max(512, *(len(d.input_ids) for d in docs)), 0)  # no document split
    return decode_path_acceptance(target, drafter, rows)


def tau_rtol(ours: dict, z: float = 3.0) -> float:
    """How far another stack's tau may lie from ``ours`` on the same prompts and outputs, as a fraction.

    Both emit the same tokens, so tau = tokens / rounds differs only by the rounds: a draft decided
    otherwise (an fp32 rounding flip) re-cuts the rest of its prompt into rounds afresh. At worst every
    prompt is re-cut from its start: the rounds of N tokens are then an independent renewal count with
    mean N / tau and variance N var / tau^3 (var: of tokens per round, ours measured), so the two
    stacks' taus differ by a relative standard deviation of sqrt(2 var / (N tau)) = sqrt(2 var / tau^2 / rounds);
    ``z`` of those (3: a false alarm in ~1 run of 370)."""
    return z * (2 * ours["var"] / ours["tau"] ** 2 / ours["rounds"]) ** 0.5


def run_vllm(python: Path, root: Path, prompts: list[list[int]], max_tokens: int, exports: dict, **options) -> dict:
    """vLLM's greedy token ids and spec-decode counters per export (``None``: the target alone) on the
    tiny target, from one process of ``python`` that builds one ``vllm.LLM`` per export in turn
    (``options``: ``serving.launch.run_vllm``'s ``cache_root``, ``in_process``)."""
    return serving_run(tiny_target_path(), prompts, max_tokens, exports, python=python, workdir=root, **options)
