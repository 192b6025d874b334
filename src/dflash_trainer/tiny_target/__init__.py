"""The embedded tiny target: a small Qwen3 causal LM trained on the Python standard library.

It ships inside the package (``assets/tiny_target``) as a standard Hugging Face folder, so the demo,
the tests and a new user need no download. ``build.py`` is the script that made it.
"""

from __future__ import annotations

from pathlib import Path

TINY_TARGET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_target"


def tiny_target_path() -> Path:
    """Folder of the embedded tiny target; a clear error if the package was installed without it."""
    if not (TINY_TARGET_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"the embedded tiny target is missing at {TINY_TARGET_DIR}; rebuild it with "
            "`python -m dflash_trainer.tiny_target.build --out <that folder>`"
        )
    return TINY_TARGET_DIR


def load_tiny_target(dtype=None):
    """``(model, tokenizer)`` of the embedded tiny target, loaded offline, model in eval mode (fp32 by default)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer
