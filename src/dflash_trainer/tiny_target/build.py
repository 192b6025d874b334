"""Build the embedded tiny target: tokenizer, Qwen3 model, training on the stdlib, evaluation.

    python -m dflash_trainer.tiny_target.build --out src/dflash_trainer/assets/tiny_target

Deterministic given ``--seed`` on a given interpreter, torch version and thread count, as long as
training ends by step count or early stopping; if the wall-clock guard (``--time-budget-min``) ends
it first, the manifest says so, because then the step count depends on the machine's speed.

Training: random windows of ``seq_len`` tokens from the concatenated training documents, AdamW,
linear warmup then cosine decay, held-out loss every ``eval_every`` steps on fixed held-out windows;
stops after ``patience`` evaluations without improvement and keeps the best weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from ..io import atomic_folder
from .corpus import HELD_OUT_MODULUS, SourceFile, load_split
from .evaluate import encode_files, heldout_metrics, unigram_counts
from .tokenizer import END_OF_TEXT, IM_END, train_bpe, wrap_for_transformers


@dataclass
class BuildSettings:
    seed: int = 0
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8  # 8 layers: the default 5-layer rule gives distinct ids 1,2,3,4,5
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    warmup_steps: int = 100
    max_steps: int = 1200
    eval_every: int = 100
    eval_windows: int = 48
    patience: int = 3
    min_improvement: float = 0.002
    chat_fraction_percent: int = 30  # share of training files rendered as a chat turn
    time_budget_min: float = 35.0
    threads: int = 2
    files_limit: int = 0  # 0 = every file; a positive N keeps the first N of each split (quick smoke builds)


def render_document(f: SourceFile, chat_percent: int) -> str:
    """A training document: raw source, or (for a deterministic share of files) a ChatML exchange
    where the user gives the file's head and the assistant continues it, so chat prompts work."""
    bucket = int(hashlib.sha256(b"chat:" + f.relpath.encode("utf-8")).hexdigest()[:8], 16) % 100
    if bucket >= chat_percent:
        return f.text + END_OF_TEXT
    lines = f.text.splitlines(keepends=True)
    head, rest = "".join(lines[:8]), "".join(lines[8:])
    if not rest.strip():
        return f.text + END_OF_TEXT
    user = f"Continue the Python module `{f.relpath}`:\n{head}"
    return f"<|im_start|>user\n{user}{IM_END}\n<|im_start|>assistant\n{rest}{IM_END}\n{END_OF_TEXT}"


def make_model(s: BuildSettings) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(s.seed)
    return Qwen3ForCausalLM(config)


def lr_at(step: int, s: BuildSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows ``[n, length]`` of a 1-D token stream."""
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[i : i + length] for i in starts.tolist()])


@torch.no_grad()
def window_loss(model, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total = 0.0
    for i in range(0, windows.shape[0], batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def build(out_dir: Path, s: BuildSettings) -> dict:
    torch.set_num_threads(s.threads)
    t0 = time.time()
    limit = s.files_limit or None
    train_files = load_split("train", limit=limit)
    held_files = load_split("held_out", limit=limit)
    print(f"corpus: {len(train_files)} train files, {len(held_files)} held-out files", flush=True)

    tok = wrap_for_transformers(train_bpe((f.text for f in train_files), s.vocab_size))
    assert tok.convert_tokens_to_ids(END_OF_TEXT) == 0, "special tokens must come first"
    docs = [render_document(f, s.chat_fraction_percent) for f in train_files]
    train_ids = tok(docs, add_special_tokens=False)["input_ids"]
    stream = torch.tensor([t for seq in train_ids for t in seq], dtype=torch.long)
    held_ids = encode_files(tok, held_files)
    held_stream = torch.tensor([t for seq in held_ids for t in seq + [0]], dtype=torch.long)
    print(
        f"tokenizer: vocab {len(tok)}; {stream.numel():,} train tokens, {held_stream.numel():,} held-out "
        f"tokens ({time.time() - t0:.0f}s)",
        flush=True,
    )

    model = make_model(s)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(s.seed)
    eval_windows = sample_windows(held_stream, s.eval_windows, s.seq_len + 1, torch.Generator().manual_seed(s.seed + 1))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
    )
    best_loss, best_state, best_step, bad_evals = float("inf"), None, 0, 0
    history = []
    stopped_by = "max_steps"
    train_start = time.time()
    bar = tqdm(range(s.max_steps), desc="tiny target", unit="step", mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        x = sample_windows(stream, s.batch_size, s.seq_len + 1, gen)
        logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", best=f"{best_loss:.3f}", refresh=False)
        if (step + 1) % s.eval_every == 0 or step + 1 == s.max_steps:
            held = window_loss(model, eval_windows, s.batch_size)
            history.append(
                {
                    "step": step + 1,
                    "train_loss": loss.item(),
                    "held_out_loss": held,
                    "elapsed_s": round(time.time() - train_start, 1),
                }
            )
            tqdm.write(f"step {step + 1}: train {loss.item():.4f} held-out {held:.4f}")
            if held < best_loss - s.min_improvement:
                best_loss, best_step, bad_evals = held, step + 1, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                bad_evals += 1
                if bad_evals >= s.patience:
                    stopped_by = "early_stopping"
                    break
        if time.time() - train_start > s.time_budget_min * 60:
            stopped_by = "time_budget"
            break
    bar.close()
    train_seconds = time.time() - train_start
    if best_state is not None:
        model.load_state_dict(best_state)

    # Ship bf16 weights (half the bytes); report metrics of exactly what ships, loaded back in fp32.
    with atomic_folder(out_dir) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        GenerationConfig(
            eos_token_id=[0, tok.convert_tokens_to_ids(IM_END)],
            pad_token_id=0,
            do_sample=False,
            max_new_tokens=64,
        ).save_pretrained(tmp)
        shipped = Qwen3ForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        metrics = heldout_metrics(shipped, held_ids, unigram=unigram_counts(train_ids, len(tok)))
        manifest = {
            "settings": dataclasses.asdict(s),
            "parameters": n_params,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "corpus": {
                "source": "Python standard library of the building interpreter (sysconfig stdlib path)",
                "split_rule": f"held out iff int(sha256(relpath)[:8], 16) % {HELD_OUT_MODULUS} == 0",
                "train_files": len(train_files),
                "held_out_files": len(held_files),
                "train_tokens": int(stream.numel()),
            },
            "training": {
                "steps_run": history[-1]["step"] if history else 0,
                "best_step": best_step,
                "stopped_by": stopped_by,
                "train_seconds": round(train_seconds, 1),
                "history": history,
            },
            "held_out": metrics,
        }
        (tmp / "build_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (replaced atomically)")
    for field in dataclasses.fields(BuildSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    settings = BuildSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BuildSettings)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    build(args.out.resolve(), settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
