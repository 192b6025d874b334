"""Held-out quality of a causal LM on standard-library source: loss, greedy next-token accuracy,
and the unigram baseline it has to beat.

Each file is scored on its own (no context from other files), in windows of ``window`` tokens that
start a fresh context; a window of n tokens gives n-1 predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .corpus import SourceFile


def encode_files(tokenizer, files: Sequence[SourceFile], max_tokens_per_file: int | None = None) -> list[list[int]]:
    """Token ids of each file's text (no special tokens), optionally truncated."""
    ids = tokenizer([f.text for f in files], add_special_tokens=False, verbose=False)["input_ids"]
    if max_tokens_per_file is not None:
        ids = [seq[:max_tokens_per_file] for seq in ids]
    return ids


def unigram_counts(token_seqs: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Token frequencies ``[V]`` (float64) over ``token_seqs``."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for seq in token_seqs:
        counts += torch.bincount(torch.as_tensor(seq, dtype=torch.long), minlength=vocab_size).double()
    return counts


@torch.no_grad()
def heldout_metrics(
    model,
    token_seqs: Sequence[Sequence[int]],
    *,
    window: int = 512,
    unigram: torch.Tensor | None = None,
) -> dict[str, float]:
    """Mean next-token loss (nats) and greedy accuracy of ``model`` over ``token_seqs``.

    With ``unigram`` (``[V]`` counts from training text), also the unigram baseline on the same
    predictions: accuracy of always guessing the most frequent token, and the loss of the add-one
    smoothed unigram distribution.
    """
    was_training = model.training
    model.eval()
    total_loss, correct, n = 0.0, 0, 0
    targets_all = []
    for seq in token_seqs:
        for start in range(0, len(seq) - 1, window):
            chunk = torch.as_tensor(seq[start : start + window], dtype=torch.long)
            if chunk.numel() < 2:
                continue
            logits = model(input_ids=chunk[None]).logits[0, :-1].float()  # [n-1, V]
            targets = chunk[1:]
            total_loss += F.cross_entropy(logits, targets, reduction="sum").item()
            correct += (logits.argmax(-1) == targets).sum().item()
            n += targets.numel()
            targets_all.append(targets)
    model.train(was_training)
    if n == 0:
        raise ValueError("no held-out predictions: every sequence is shorter than 2 tokens")
    out = {"loss": total_loss / n, "accuracy": correct / n, "tokens": float(n)}
    if unigram is not None:
        targets = torch.cat(targets_all)
        smoothed = (unigram + 1.0) / (unigram.sum() + unigram.numel())
        out["unigram_accuracy"] = (targets == int(unigram.argmax())).double().mean().item()
        out["unigram_loss"] = -smoothed.log()[targets].mean().item()
        out["perplexity"] = math.exp(out["loss"])
    return out
