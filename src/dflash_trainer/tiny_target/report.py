"""Measure a target's held-out quality on the stdlib split: loss, greedy next-token accuracy,
and the unigram baseline (most frequent training token; add-one-smoothed unigram loss).

    dflash-train tiny-target eval [--path FOLDER] [--files N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .corpus import load_split
from .evaluate import encode_files, heldout_metrics, unigram_counts


def measure(
    path: Path | None = None,
    files: int | None = None,
    max_tokens_per_file: int | None = None,
    unigram_files: int | None = None,
) -> dict[str, float]:
    """Held-out metrics of the model at ``path`` (default: the embedded tiny target), fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import tiny_target_path

    path = path or tiny_target_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    held = encode_files(tokenizer, load_split("held_out", limit=files), max_tokens_per_file)
    train = encode_files(tokenizer, load_split("train", limit=unigram_files))
    return heldout_metrics(model, held, unigram=unigram_counts(train, len(tokenizer)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-train tiny-target eval", description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=None, help="model folder (default: the embedded tiny target)")
    parser.add_argument("--files", type=int, default=None, help="first N held-out files (default: all)")
    parser.add_argument("--max-tokens-per-file", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the metrics here")
    args = parser.parse_args(argv)
    metrics = measure(args.path, args.files, args.max_tokens_per_file)
    text = json.dumps(metrics, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
