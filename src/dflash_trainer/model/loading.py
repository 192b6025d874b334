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


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``folder`` that holds it (from the index when sharded)."""
    import json

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise TargetLoadError(f"cannot read {index}: {exc}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise TargetLoadError(f"{folder} has no model.safetensors(.index.json): the head is read by tensor name")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _checkpoint_key(files: dict[str, Path], name: str) -> str:
    """The checkpoint's name for module parameter ``name``: the same, or the one key that ends with it
    once leading prefixes are dropped (checkpoints of some families name the body differently)."""
    if name in files:
        return name
    parts = name.split(".")
    for cut in range(1, len(parts) - 1):
        suffix = "." + ".".join(parts[cut:])
        found = [k for k in files if k.endswith(suffix)]
        if len(found) == 1:
            return found[0]
    raise TargetLoadError(f"the target's weights have no tensor {name} (nor one unique key ending like it)")


def load_target_head(cfg: TargetConfig, layer_ids: list[int] | None = None, *, final_norm: bool = False):
    """``(TargetModel without body, tokenizer, tensor names read)``: what a drafter trained from cached
    features needs of the target, its input embedding and output head, read by tensor name from the
    folder's safetensors. The model is built on the meta device, so the body's weights are neither
    allocated nor read (the names returned are everything read). ``final_norm``: the body's final norm
    too (``body.norm``), for teacher states computed elsewhere before it (capture from vLLM)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .target import TargetModel

    folder = resolve_target_path(cfg.path)
    dtype = getattr(torch, cfg.dtype)
    _quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except _load_errors() as exc:
        raise TargetLoadError(f"cannot load target from {folder}: {_first_line(exc)}") from None
    files = _weight_files(folder)
    names: dict[int, list[str]] = {}  # a tied parameter has several names: the embedding's comes first
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    from .target import text_config

    tied = head is None or head.weight is emb.weight or bool(getattr(text_config(config), "tie_word_embeddings", False))
    wanted = [(m, "weight") for m in [emb] + ([] if tied else [head])]
    if final_norm:
        norm = getattr(model.get_decoder(), "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise TargetLoadError(
                f"{type(model).__name__} has no final norm at .norm: capture with --engine transformers"
            )
        wanted += [(norm, name) for name, _ in norm.named_parameters(recurse=False)]
    read = []
    for module, attr in wanted:
        key = _checkpoint_key(files, names[id(getattr(module, attr))][0])
        try:
            with safe_open(str(files[key]), framework="pt") as f:
                weight = f.get_tensor(key)
        except _load_errors() as exc:
            raise TargetLoadError(f"cannot read {key} from {files[key]}: {_first_line(exc)}") from None
        setattr(module, attr, torch.nn.Parameter(weight.to(dtype), requires_grad=False))
        read.append(key)
    for name, buf in list(emb.named_buffers(recurse=False)):
        if buf.is_meta:  # a buffer the constructor computed (Gemma's embed_scale), lost on the meta device
            scalar = getattr(emb, f"scalar_{name}", None)
            if scalar is None:
                raise TargetLoadError(f"cannot rebuild the embedding's buffer {name} without loading the model")
            emb.register_buffer(name, torch.tensor(float(scalar), dtype=dtype), persistent=False)
    if tied and head is not None:
        head.weight = emb.weight  # tied: replacing the embedding's parameter broke the tie
    ids = layer_ids if layer_ids is not None else cfg.layer_ids
    k = len(ids) if ids is not None else cfg.num_feature_layers
    return TargetModel(model, layer_ids=ids, num_feature_layers=k, body=False), tokenizer, read


def target_identity(cfg: TargetConfig, target) -> dict:
    """What a feature cache records of the target that produced it, and a run compares: its shape, the
    dtype it ran in, the sha256 of its config.json and of its embedding and head as loaded (read by a
    run from cached features anyway). ``path`` is for messages only; a moved folder still matches."""
    import hashlib

    import torch

    folder = resolve_target_path(cfg.path)
    h = hashlib.sha256()
    weights = [target.embed_tokens.weight, target.lm_head_weight]
    for w in weights[: 1 if weights[1] is weights[0] else 2]:
        h.update(w.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {
        "path": str(folder),
        "architectures": list(getattr(target.model.config, "architectures", None) or [type(target.model).__name__]),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": cfg.dtype,
        "config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
        "embedding_and_head_sha256": h.hexdigest(),
    }
