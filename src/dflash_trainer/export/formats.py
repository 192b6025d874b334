"""Export a drafter checkpoint for serving, load exports back, and check an export against its target.

Formats:
- ``zlab``: what DFlash drafters are published in and SGLang/vLLM load: a Qwen3 config with
  ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers``,
  ``dflash_config {mask_token_id, target_layer_ids}`` (z-lab ids: id l = output of target layer l),
  ``layer_types``/``sliding_window``, bf16 weights ``layers.*``, ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight`` (no embedding, no lm_head), and this project's ``modeling_dflash.py`` for
  ``trust_remote_code``.
- ``speculators``: ``speculators_model_type: "dflash"``, ``transformer_layer_config``,
  ``aux_hidden_state_layer_ids`` (vLLM's ids = z-lab ids + 1: converted here and nowhere else),
  ``mask_token_id``, ``block_size``, ``speculators_config``; the target's embedding and lm_head are
  copied in as ``embed_tokens.weight`` and ``lm_head.weight``.

Both record ``target_transforms`` (``embedding_scale``, ``logit_scale``, ``logit_softcap``): what the
drafter trained with through the target's own modules (Gemma multiplies embeddings by sqrt(hidden) and
soft-caps logits). The speculators folder stores ``embed_tokens.weight`` with the scale already applied
(``embedding_scale_in_weights``), so a plain lookup gives the rows the drafter trained on; ``--check``
compares the recorded transforms with the target's.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..io import atomic_folder
from ..model.drafter import DFlashDrafter, DrafterSpec
from ..training.checkpoint import WEIGHTS as CKPT_WEIGHTS
from ..training.checkpoint import check_against_target, checkpoint_spec, read_checkpoint_config

MODEL_WEIGHTS = "model.safetensors"
DRAFTER_KEYS = ("fc.", "hidden_norm.", "layers.", "norm.")


def _layer_config(spec: DrafterSpec) -> dict:
    """The Qwen3 decoder-layer config shared by both formats."""
    layer_types = [
        "sliding_attention" if i in spec.sliding_window_layers else "full_attention" for i in range(spec.num_layers)
    ]
    cfg = {
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "rope_theta": spec.rope_theta,
        "vocab_size": spec.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": layer_types,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    if spec.sliding_window_layers:
        cfg["sliding_window"] = spec.sliding_window
        cfg["use_sliding_window"] = True
    return cfg


def _write_folder(out_dir: Path, files: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
    """Write JSON/text files and one safetensors file into ``out_dir`` atomically."""
    with atomic_folder(Path(out_dir)) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / MODEL_WEIGHTS), metadata={"format": "pt"})
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
            (tmp / name).write_text(text, encoding="utf-8")


def target_transforms(spec: DrafterSpec, scale: float) -> dict:
    """The embedding/logit transforms the drafter trained with (recorded in both export formats)."""
    return {"embedding_scale": scale, "logit_scale": spec.logit_scale, "logit_softcap": spec.logit_softcap}


def _recorded_transforms(cfg: dict) -> dict | None:
    return cfg.get("target_transforms") or (cfg.get("dflash_config") or {}).get("target_transforms")


def transform_problems(cfg: dict, target_dir: Path) -> list[str]:
    """An export's recorded transforms against the target's (embedding scale, logit scale, softcap)."""
    from transformers import AutoConfig

    from ..model.target import config_embedding_scale, head_logit_options

    tcfg = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    head = head_logit_options(tcfg)
    want = {
        "embedding_scale": config_embedding_scale(tcfg),
        "logit_scale": head["logit_scale"],
        "logit_softcap": head["softcap"],
    }
    got = _recorded_transforms(cfg) or {"embedding_scale": 1.0, "logit_scale": 1.0, "logit_softcap": None}
    problems = []
    for key, value in want.items():
        have = got.get(key)
        same = (have is None and value is None) or (
            have is not None and value is not None and abs(float(have) - float(value)) <= 1e-6 * max(1.0, abs(value))
        )
        if not same:
            problems.append(f"{key} {have} recorded, but the target applies {value} (the drafter trained with it)")
    if cfg.get("speculators_model_type") == "dflash" and want["embedding_scale"] != 1.0:
        if not (_recorded_transforms(cfg) or {}).get("embedding_scale_in_weights"):
            problems.append("embed_tokens.weight is the raw table; the drafter trained on scaled embeddings")
    return problems


def export_checkpoint(checkpoint: Path, out_dir: Path, fmt: str, *, target_model=None) -> Path:
    """Export ``checkpoint`` as ``fmt`` ("zlab" or "speculators"). The speculators format copies the
    target's embedding and lm_head, so it needs ``target_model`` (a HF causal LM)."""
    meta = read_checkpoint_config(checkpoint)
    spec = checkpoint_spec(meta)
    target = meta["target"]
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(Path(checkpoint) / CKPT_WEIGHTS)).items()}
    if fmt == "zlab":
        config = {
            **_layer_config(spec),
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},
            "block_size": spec.block_size,
            "num_target_layers": target["num_layers"],
            "dflash_config": {
                "mask_token_id": spec.mask_token_id,
                "target_layer_ids": list(target["layer_ids"]),
                "causal_in_block_sliding": spec.causal_in_block_sliding,
                "target_model_path": target.get("path"),
                "target_transforms": target_transforms(spec, _scale(target_model, target)),
            },
        }
        modeling = (resources.files("dflash_trainer.export") / "assets" / "modeling_dflash.py").read_text()
        _write_folder(out_dir, {"config.json": config, "modeling_dflash.py": modeling}, state)
    elif fmt == "speculators":
        if target_model is None:
            raise UserError("the speculators format copies the target's embedding and lm_head: the target is needed")
        scale = _scale(target_model, target)
        # the drafter looked rows up through the target's module, which scales them (Gemma): bake it in
        embed = (target_model.get_input_embeddings().weight.detach().float() * scale).to(torch.bfloat16)
        head = target_model.get_output_embeddings().weight.detach().to(torch.bfloat16)
        config = {
            "speculators_model_type": "dflash",
            "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": _layer_config(spec),
            "aux_hidden_state_layer_ids": [i + 1 for i in target["layer_ids"]],  # z-lab id + 1
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
            "draft_vocab_size": spec.vocab_size,
            "target_hidden_size": target["hidden_size"],
            "sliding_window_non_causal": not spec.causal_in_block_sliding,
            "target_transforms": {**target_transforms(spec, scale), "embedding_scale_in_weights": True},
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.block_size - 1}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target.get("path"), "architectures": target["architectures"]},
            },
        }
        _write_folder(
            out_dir,
            {"config.json": config},
            {**state, "embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()},
        )
    else:
        raise UserError(f"unknown export format {fmt!r}: use 'zlab' or 'speculators'")
    return Path(out_dir)


def _scale(target_model, target_meta: dict) -> float | None:
    """The target's embedding scale: from the loaded model, else from its config (meta device)."""
    from ..model.target import config_embedding_scale, embedding_scale

    if target_model is not None:
        return embedding_scale(target_model)
    path = target_meta.get("path")
    if not path:
        return 1.0
    from transformers import AutoConfig

    from ..model.loading import resolve_target_path

    try:
        return config_embedding_scale(AutoConfig.from_pretrained(resolve_target_path(path), local_files_only=True))
    except (UserError, OSError, ValueError):
        return None  # target not here: recorded as unknown, and --check against the target says so


def read_export(folder: Path) -> tuple[str, DrafterSpec, list[int], int, dict]:
    """``(format, spec, z-lab layer ids, target layer count or -1, config)`` of an exported folder."""
    cfg_file = Path(folder) / "config.json"
    if not cfg_file.is_file() or not (Path(folder) / MODEL_WEIGHTS).is_file():
        raise UserError(f"{folder} is not an exported drafter (expected config.json and {MODEL_WEIGHTS})")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("speculators_model_type") == "dflash":
        fmt, layer_cfg = "speculators", cfg["transformer_layer_config"]
        layer_ids = [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]
        mask_id, block, causal, n_target = (
            cfg["mask_token_id"],
            cfg["block_size"],
            not cfg.get("sliding_window_non_causal", True),
            -1,
        )
    elif "DFlashDraftModel" in (cfg.get("architectures") or []):
        fmt, layer_cfg = "zlab", cfg
        dcfg = cfg["dflash_config"]
        layer_ids, mask_id, block = list(dcfg["target_layer_ids"]), dcfg["mask_token_id"], cfg["block_size"]
        causal, n_target = bool(dcfg.get("causal_in_block_sliding", False)), cfg.get("num_target_layers", -1)
    else:
        raise UserError(f"{cfg_file}: neither a zlab (architectures DFlashDraftModel) nor a speculators dflash export")
    types = layer_cfg.get("layer_types") or []
    transforms = _recorded_transforms(cfg) or {}
    spec = DrafterSpec(
        hidden_size=layer_cfg["hidden_size"],
        num_heads=layer_cfg["num_attention_heads"],
        num_kv_heads=layer_cfg["num_key_value_heads"],
        head_dim=layer_cfg["head_dim"],
        intermediate_size=layer_cfg["intermediate_size"],
        vocab_size=layer_cfg["vocab_size"],
        num_layers=layer_cfg["num_hidden_layers"],
        num_features=len(layer_ids),
        block_size=block,
        rms_norm_eps=layer_cfg["rms_norm_eps"],
        rope_theta=float(layer_cfg.get("rope_theta", 1e6)),
        sliding_window_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        sliding_window=layer_cfg.get("sliding_window") or 2048,
        causal_in_block_sliding=causal,
        mask_token_id=mask_id,
        logit_scale=float(transforms.get("logit_scale") or 1.0),
        logit_softcap=transforms.get("logit_softcap"),
    )
    return fmt, spec, layer_ids, n_target, cfg


def load_export(folder: Path, target, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A ``DFlashDrafter`` from an exported folder of either format, for ``target`` (a ``TargetModel``)."""
    _, spec, layer_ids, _, _ = read_export(folder)
    check_against_target(spec, layer_ids, target, f"export {folder}")
    state = load_file(str(Path(folder) / MODEL_WEIGHTS))
    drafter = DFlashDrafter(spec, target.embed_tokens, target.lm_head_weight)
    drafter.load_state_dict({k: v for k, v in state.items() if k.startswith(DRAFTER_KEYS)})
    return drafter.to(dtype).eval()


def check_export(folder: Path, target_path: str | None = None) -> list[str]:
    """Problems of an exported folder against the target it names (or ``target_path``), one line each."""
    from transformers import AutoConfig, AutoTokenizer

    from ..model.loading import resolve_target_path
    from ..model.target import text_config

    fmt, spec, layer_ids, n_target, cfg = read_export(folder)
    named = (
        cfg["dflash_config"].get("target_model_path")
        if fmt == "zlab"
        else cfg["speculators_config"]["verifier"].get("name_or_path")
    )
    path = target_path or named
    if not path:
        return ["the export names no target; pass --target PATH"]
    tdir = resolve_target_path(path)
    tcfg = text_config(AutoConfig.from_pretrained(tdir, local_files_only=True))
    problems = []
    if spec.hidden_size != tcfg.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} does not match the target's {tcfg.hidden_size}")
    if spec.vocab_size != tcfg.vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} does not match the target's {tcfg.vocab_size}")
    n_layers = tcfg.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        hint = " (speculators ids are z-lab ids + 1: an off-by-one export?)" if fmt == "speculators" else ""
        problems.append(f"target layer ids {bad} are outside the target's 0..{n_layers - 1}{hint}")
    if n_target not in (-1, n_layers):
        problems.append(f"num_target_layers {n_target} does not match the target's {n_layers} layers")
    if not 0 <= spec.mask_token_id < tcfg.vocab_size:
        problems.append(f"mask token id {spec.mask_token_id} is outside the target vocabulary 0..{tcfg.vocab_size - 1}")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
            tok_mask = tok.mask_token_id if tok.mask_token_id is not None else tok.convert_tokens_to_ids("<|MASK|>")
            if tok_mask not in (None, tok.unk_token_id) and tok_mask != spec.mask_token_id:
                problems.append(
                    f"mask token id {spec.mask_token_id} is not the target tokenizer's <|MASK|> ({tok_mask})"
                )
        except (OSError, ValueError):
            pass  # a target without tokenizer files: the id range check above still holds
    problems += transform_problems(cfg, tdir)
    if spec.block_size < 2:
        problems.append(f"block size {spec.block_size} is below 2")
    if fmt == "speculators":
        tokens = cfg["speculators_config"]["proposal_methods"][0].get("speculative_tokens")
        if tokens != spec.block_size - 1:
            problems.append(f"speculative_tokens {tokens} does not equal block_size - 1 = {spec.block_size - 1}")
    state = load_file(str(Path(folder) / MODEL_WEIGHTS))
    fc = state.get("fc.weight")
    if fc is None:
        problems.append("weights have no fc.weight")
    elif tuple(fc.shape) != (spec.hidden_size, len(layer_ids) * spec.hidden_size):
        problems.append(
            f"fc.weight is {tuple(fc.shape)}, expected ({spec.hidden_size}, {len(layer_ids)} layer ids x "
            f"{spec.hidden_size}): layer-id count and weights disagree"
        )
    return problems
