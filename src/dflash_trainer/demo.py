"""The main job, end to end on a target (by default the embedded tiny target).

Until the trainer lands, the job is what the package can already do end to end: resolve and record
the run's config, load the target offline, score it on held-out standard-library files against the
unigram baseline, and greedily continue a code prompt and a chat prompt. Everything is written to
``output_dir`` (``run.yaml``, ``demo.json``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .config import RunConfig, write_resolved_config
from .target_loading import load_target, resolve_target_path
from .tiny_target.corpus import load_split
from .tiny_target.evaluate import encode_files, heldout_metrics, unigram_counts

# Ends inside the function body's indentation: byte-level BPE merges "\n" with the indentation that
# follows, so a prompt ending in a bare newline is a token boundary the model never saw in training.
DEFAULT_PROMPT = '"""Utilities for parsing dates."""\n\nimport re\n\n\ndef parse_date(text):\n    '
CHAT_PROMPT = "Continue the Python module `json/example.py`:\nimport json\n\n\ndef load_config(path):\n"


@torch.no_grad()
def greedy_continue(model, tokenizer, text: str, max_new_tokens: int) -> str:
    """Greedy continuation of ``text`` (HF ``generate`` with its KV cache), decoded without specials."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def run_demo(cfg: RunConfig, *, prompt: str | None = None, max_new_tokens: int = 48, eval_files: int = 24) -> dict:
    resolve_target_path(cfg.target.path)  # fail on a bad target before anything is written
    out_dir = Path(cfg.output_dir)
    config_path = write_resolved_config(cfg, out_dir)
    print(f"[1/4] resolved config written to {config_path}", flush=True)

    t0 = time.time()
    model, tokenizer, folder = load_target(cfg.target)
    mc = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[2/4] target {folder}: {type(model).__name__}, {mc.num_hidden_layers} layers, hidden {mc.hidden_size}, "
          f"vocab {mc.vocab_size}, {n_params / 1e6:.1f}M parameters, {cfg.target.dtype} "
          f"({time.time() - t0:.1f}s)", flush=True)

    t0 = time.time()
    held = encode_files(tokenizer, load_split("held_out", limit=eval_files), max_tokens_per_file=512)
    train = encode_files(tokenizer, load_split("train", limit=200))
    metrics = heldout_metrics(model, held, window=512, unigram=unigram_counts(train, len(tokenizer)))
    print(f"[3/4] held-out stdlib ({eval_files} files, {int(metrics['tokens'])} predictions): "
          f"loss {metrics['loss']:.3f} nats, greedy next-token accuracy {metrics['accuracy']:.1%} "
          f"vs unigram baseline {metrics['unigram_accuracy']:.1%} ({time.time() - t0:.1f}s)", flush=True)

    prompt = prompt if prompt is not None else DEFAULT_PROMPT
    code_out = greedy_continue(model, tokenizer, prompt, max_new_tokens)
    chat_out = None
    if tokenizer.chat_template:
        chat_text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], tokenize=False,
                                                  add_generation_prompt=True)
        chat_out = greedy_continue(model, tokenizer, chat_text, max_new_tokens)
    print("[4/4] greedy continuation:\n" + "-" * 60 + f"\n{prompt}{code_out}\n" + "-" * 60, flush=True)
    if chat_out is not None:
        print(f"chat reply to a request to continue a module:\n{chat_out}\n" + "-" * 60, flush=True)

    summary = {"target": str(folder), "parameters": n_params, "held_out": metrics,
               "prompt": prompt, "continuation": code_out, "chat_reply": chat_out}
    (out_dir / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary written to {out_dir / 'demo.json'}")
    return summary
