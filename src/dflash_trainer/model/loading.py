"""Load a target causal LM and its tokenizer from a local folder, offline, with clear errors."""

from __future__ import annotations

from pathlib import Path

from ..config import TINY_TARGET, TargetConfig
from ..errors import UserError


class TargetLoadError(UserError, ValueError):
    """The configured target cannot be loaded; the message says why in one line."""


def resolve_target_path(path: str | None) -> Path:
    """``"tiny"`` -> the embedded tiny target; otherwise an existing local model folder."""
    if path is None:
        raise TargetLoadError("target.path is not set: pass --set target.path=/path/to/model (or 'tiny')")
    if path == TINY_TARGET:
        from ..tiny_target import tiny_target_path

        try:
            return tiny_target_path()
        except FileNotFoundError as exc:
            raise TargetLoadError(str(exc)) from None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TargetLoadError(f"target.path {path} is not a folder (models load from local paths only)")
    if not (folder / "config.json").is_file():
        raise TargetLoadError(f"target.path {path} has no config.json: not a Hugging Face model folder")
    return folder


def _quiet_transformers() -> None:
    """No loading bars and no advisory warnings from transformers on stderr: a failing command's stderr
    is then its one error line, and a working one's is the project's own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a broken model folder raises while loading: a truncated ``model.safetensors`` raises
    ``SafetensorError`` (neither an ``OSError`` nor a ``ValueError``), a bad shard ``RuntimeError``."""
    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, SafetensorError)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def load_target_config(path: str | None):
    """``(text config, tokenizer, folder)`` of a target without loading its weights: for checks that
    must fail in seconds, before a 54 GB model is read."""
    from transformers import AutoConfig, AutoTokenizer

    from .target import text_config

    folder = resolve_target_path(path)
    _quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except _load_errors() as exc:
        raise TargetLoadError(f"cannot load target from {folder}: {_first_line(exc)}") from None
    return text_config(config), tokenizer, folder


def load_target_model(cfg: TargetConfig, layer_ids: list[int] | None = None):
    """``(TargetModel, tokenizer)``: the one way to get a target for features. ``layer_ids`` (e.g. a
    checkpoint's) win over ``cfg.layer_ids``; neither set = the default rule for ``cfg.num_feature_layers``."""
    from .target import TargetModel

    model, tokenizer, _ = load_target(cfg)
    ids = layer_ids if layer_ids is not None else cfg.layer_ids
    k = len(ids) if ids is not None else cfg.num_feature_layers
    return TargetModel(model, layer_ids=ids, num_feature_layers=k), tokenizer


def load_target(cfg: TargetConfig):
    """``(model, tokenizer, path)``: the frozen target in eval mode, in ``cfg.dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_target_path(cfg.path)
    dtype = getattr(torch, cfg.dtype)
    _quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except _load_errors() as exc:
        raise TargetLoadError(f"cannot load target from {folder}: {_first_line(exc)}") from None
    model.eval().requires_grad_(False)
    return model, tokenizer, folder
