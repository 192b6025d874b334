"""Read any DFlash drafter folder, whoever wrote it, into this project's ``DFlashDrafter``.

Two layouts exist in the field, each written by more than one tool:

- **z-lab** (``architectures: ["DFlashDraftModel"]``, a Qwen3 config at the top): z-lab's published
  checkpoints (written by transformers 4.x: top-level ``rope_theta``), z-lab's ``DFlashDraftModel``
  (PyPI ``dflash``) ``save_pretrained`` (transformers 5: ``rope_parameters``), SpecForge's
  ``DFlashDraftModel`` (PyPI ``specforge``) ``save_pretrained``, and this project's
  ``export --format zlab``. z-lab's code reads each of ``target_layer_ids``, ``block_size`` (default
  16), ``mask_token_id``, ``input_embedding_scale``, ``output_multiplier`` and
  ``final_logit_softcapping`` from ``dflash_config`` first, then from the top level; older code
  defaulted the layer ids from ``num_target_layers``. Ids are z-lab ids (transformers'
  ``hidden_states[l + 1]``). A folder naming ``DFlash2DraftModel`` (or holding its ``dflash_config``
  fields ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``) is a DFlash2
  drafter (``Variant.zlab_architecture``, ``zlab_fields``); its codebooks may be stored with or without
  ``.weight`` (z-lab's save_pretrained, or speculators' names: ``Variant.key_aliases``).
- **speculators** (``speculators_model_type: "dflash"``, or a drafter variant's type such as
  ``"dspark"``, the layers' config in ``transformer_layer_config``): speculators' ``save_pretrained``
  (no embedding or head inside: its loader takes both from the verifier) and this project's
  ``export --format speculators``; a variant reads its own fields (``Variant.read_speculators_config``). Ids are
  ``aux_hidden_state_layer_ids`` = z-lab ids + 1; ``block_size`` defaults to 8 and
  ``sliding_window_non_causal`` to its config class's default (false; true for ``dflash2``).

The layers' config is parsed with transformers' own config class for its ``model_type``, as both
writers' model code does, so defaults, legacy keys and RoPE parameters in either place mean what they
mean there. What this project's drafter cannot compute is refused with one line naming the field:
other RoPE types, attention or MLP biases, other activations, a reduced draft vocabulary, sampling from
the anchor in a DFlash drafter, z-lab's own sliding-window and causal rules (a folder this project did
not write), extra tensors, and hooks this project cannot place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from pydantic import Field
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import JsonRecord, UserError, check_schema
from ..model.drafter import DFlashDrafter, DrafterSpec
from ..variants import make_drafter, registered, variant_of

MODEL_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded weights (transformers' save_pretrained)
EXPORT_INFO = "export_info.json"  # written by this project's export only
DRAFTER_KEYS = ("fc.", "hidden_norm.", "layers.", "norm.")
# Tensors a writer may store beside the drafter's own: the verifier's tables (speculators reloads them
# from the verifier; this project's drafter shares the target's).
IGNORED_KEYS = {"embed_tokens.weight", "lm_head.weight", "verifier_norm.weight", "verifier_lm_head.weight"}


@dataclass
class DrafterFolder:
    """A drafter folder as its writer's code reads it."""

    fmt: str  # "zlab" or "speculators"
    spec: DrafterSpec
    layer_ids: list[int]  # z-lab ids: id l = output of target decoder layer l
    num_target_layers: int  # -1 when the folder does not say
    config: dict  # config.json as written
    verifier: str | None  # the target the folder names (speculators' verifier, z-lab's target_model_path)
    embedding_scale: float  # z-lab's input_embedding_scale (only 1 is read: the drafter embeds unscaled)
    ours: bool  # written by this project's export (export_info.json)


# The fields of a foreign config.json this reader uses, typed (strict JSON types; a float field takes an
# int): checked in one place before anything reads them, so a field of the wrong type is one line naming
# it. Other fields are kept as written (transformers' config class reads the layers' own).


class _LayerFields(JsonRecord):
    model_type: str | None = None
    hidden_size: int = Field(None, gt=0)
    intermediate_size: int = Field(None, gt=0)
    num_hidden_layers: int = Field(None, gt=0)
    num_attention_heads: int = Field(None, gt=0)
    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    vocab_size: int = Field(None, gt=0)
    rms_norm_eps: float = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    use_sliding_window: bool | None = None
    layer_types: list[str] | None = None
    hidden_act: str | None = None
    attention_bias: bool | None = None
    mlp_bias: bool | None = None
    architectures: list[str] | None = None


class _ZlabFields(JsonRecord):  # z-lab reads each from dflash_config first, then the top level
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = Field(None, ge=0)
    block_size: int | None = Field(None, ge=2)
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    causal_in_block_sliding: bool | None = None
    target_transforms: dict | None = None
    target_model_path: str | None = None
    pure_draft_prefix_len: int | None = None
    shift_label: bool | None = None


class _ZlabConfig(_LayerFields, _ZlabFields):
    num_target_layers: int | None = None
    dflash_config: _ZlabFields | None = None


class _Verifier(JsonRecord):
    name_or_path: str | None = None


class _SpeculatorsInner(JsonRecord):
    verifier: _Verifier | None = None


class _SpeculatorsConfig(JsonRecord):
    speculators_model_type: str
    transformer_layer_config: _LayerFields | None = None
    aux_hidden_state_layer_ids: list[int] | None = None
    mask_token_id: int | None = Field(None, ge=0)
    draft_vocab_size: int | None = Field(None, gt=0)
    block_size: int | None = Field(None, ge=2)
    sliding_window_non_causal: bool | None = None
    sample_from_anchor: bool | None = None
    target_transforms: dict | None = None
    speculators_config: _SpeculatorsInner | None = None


def check_foreign_config(cfg: dict, cfg_file: Path) -> None:
    """``UserError`` (one line naming the field) for a field of ``config.json`` this reader uses that has
    the wrong type: the folder is damaged or written by something else."""
    schema = _SpeculatorsConfig if "speculators_model_type" in cfg else _ZlabConfig
    check_schema(schema, cfg, str(cfg_file), "fix that field or export the drafter again")


def _layer_config(raw: dict, where: str):
    """``raw`` read by transformers' config class for its model_type (qwen3 when it names none)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(raw.get("model_type") or "qwen3", **fields)
    except (ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"{where}: transformers cannot read its layer config ({first})") from None


# The RoPE scaling keys the drafter computes (model/rope.py); other keys of a scaled rope_parameters
# (mscale, long/short factors...) change the frequencies in ways it does not, and are refused.
_SCALING_KEYS = {
    "linear": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"},
}


def _rope(layer, where: str) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a parsed layer config, from ``rope_parameters`` (transformers 5)
    or a top-level ``rope_theta`` (transformers 4 configs, converted by the config class); the scaling is
    None for default RoPE, else the linear or YaRN entries ``DrafterSpec.rope_scaling`` holds."""
    rope = dict(getattr(layer, "rope_parameters", None) or {})
    if {"full_attention", "sliding_attention"} & rope.keys():  # one set per layer type
        variants = {json.dumps(v, sort_keys=True) for v in rope.values()}
        if len(variants) > 1:
            raise UserError(f"{where}: RoPE parameters differ per layer type; this project's drafter has one RoPE")
        rope = next(iter(rope.values()))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", *_SCALING_KEYS):
        raise UserError(f"{where}: RoPE type {kind!r}; this project's drafter computes default, linear and yarn RoPE")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor {rope['partial_rotary_factor']}; the drafter rotates all dims")
    theta = rope.get("rope_theta", getattr(layer, "rope_theta", None))
    if theta is None:
        raise UserError(f"{where}: its layer config gives no rope_theta")
    if kind == "default":
        return float(theta), None
    ignored = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    unknown = sorted(k for k, v in rope.items() if k not in _SCALING_KEYS[kind] | ignored and v is not None)
    if unknown:
        raise UserError(f"{where}: {kind} RoPE with {unknown}; the drafter computes {sorted(_SCALING_KEYS[kind])} only")
    if kind == "yarn" and rope.get("original_max_position_embeddings") is None:
        raise UserError(f"{where}: yarn RoPE without original_max_position_embeddings")
    scaling = {"rope_type": kind, **{k: v for k, v in rope.items() if k in _SCALING_KEYS[kind] and v is not None}}
    return float(theta), scaling


def _refuse_unrepresentable_layers(layer, where: str) -> None:
    if getattr(layer, "attention_bias", False):
        raise UserError(f"{where}: attention_bias is true; this project's drafter has no attention biases")
    if getattr(layer, "mlp_bias", False):
        raise UserError(f"{where}: mlp_bias is true; this project's drafter has no MLP biases")
    if getattr(layer, "hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {layer.hidden_act!r}; this project's drafter's MLP is SwiGLU (silu)")
    unknown = sorted(set(getattr(layer, "layer_types", None) or []) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UserError(f"{where}: layer types {unknown}; the drafter has full and sliding attention only")


def zlab_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The ids older z-lab code used when ``target_layer_ids`` is absent (one per draft layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _zlab_variant(archs: list[str], value):
    """The variant a z-lab folder holds: the one whose z-lab class it names or whose ``dflash_config``
    fields it has (DFlash2: ``DFlash2DraftModel``, ``conv_kernel_size`` ...), else DFlash."""
    for variant in registered():
        if variant.zlab_fields and (
            variant.zlab_architecture in archs or any(value(name) is not None for name in variant.zlab_fields)
        ):
            return variant
    return variant_of("dflash")


def _zlab(cfg: dict, where: str, ours: bool):
    """``(layer config, layer ids, block size, mask id, causal_in_block, n_target, transforms, variant,
    variant options)``."""
    dcfg = cfg.get("dflash_config") or {}
    archs = cfg.get("architectures") or []

    def value(name, default=None):  # z-lab's _draft_value: dflash_config first, then the top level
        return dcfg.get(name, cfg.get(name, default))

    variant = _zlab_variant(archs, value)
    options = variant.read_zlab_config({name: value(name) for name in variant.zlab_fields}, where)
    # SpecForge's DFlashDraftModel (the same layout) has options that change what the drafter computes
    for key, neutral in (("projector_type", None), ("pure_draft_prefix_len", 0), ("shift_label", False)):
        if dcfg.get(key, neutral) not in (neutral, None):
            raise UserError(
                f"{where}: dflash_config.{key} {dcfg[key]!r} (SpecForge), which this project's drafter lacks"
            )
    layer = _layer_config(cfg, where)
    n_target = cfg.get("num_target_layers", -1)
    layer_ids = value("target_layer_ids")
    if layer_ids is None:
        if n_target in (-1, None):
            raise UserError(f"{where}: neither dflash_config.target_layer_ids nor num_target_layers is given")
        layer_ids = zlab_default_layer_ids(n_target, layer.num_hidden_layers)
    mask_id = value("mask_token_id")
    if mask_id is None:
        raise UserError(f"{where}: no mask_token_id (dflash_config.mask_token_id)")
    sliding = bool(layer.sliding_window) and "sliding_attention" in (layer.layer_types or [])
    if not ours and (sliding or getattr(layer, "is_causal", None) is not None):
        # z-lab's code counts a sliding layer's window over [context ; block] keys and makes it causal
        # over both (is_causal); this project's drafter sees the last W context rows plus the block.
        raise UserError(
            f"{where}: z-lab's sliding-window / is_causal attention rule (its window spans context and "
            "block keys), which this project's drafter does not compute"
        )
    transforms = dcfg.get("target_transforms") or {
        "logit_scale": float(value("output_multiplier", 1.0)),
        "logit_softcap": float(value("final_logit_softcapping")) if value("final_logit_softcapping") else None,
    }
    scale = float(value("input_embedding_scale", 1.0))
    if scale != 1.0:  # z-lab multiplies the raw table's rows; this project's drafter looks them up as they are
        raise UserError(f"{where}: input_embedding_scale {scale:g}; this project's drafter embeds blocks unscaled")
    causal = bool(dcfg.get("causal_in_block_sliding", False))
    block = int(value("block_size", 16))
    return layer, list(layer_ids), block, mask_id, causal, n_target, transforms, variant.name, options


def _speculators(cfg: dict, where: str):
    kind = cfg.get("speculators_model_type")
    readable = {}
    for v in registered():  # a variant without a speculators layout has no speculators_type
        if v.speculators_type:
            readable.setdefault(v.speculators_type, v)
    if kind not in readable:
        raise UserError(f"{where}: speculators_model_type {kind!r}; the drafters read are {sorted(readable)}")
    variant = readable[kind]
    options = variant.read_speculators_config(cfg, where)
    layer = _layer_config(cfg.get("transformer_layer_config") or {}, where)
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not aux:
        raise UserError(f"{where}: no aux_hidden_state_layer_ids")
    if min(aux) < 1:
        raise UserError(
            f"{where}: aux_hidden_state_layer_ids {aux} include 0 (the embedding output), which this "
            "project's target hooks cannot capture"
        )
    if cfg.get("mask_token_id") is None:
        raise UserError(f"{where}: no mask_token_id")
    draft_vocab = cfg.get("draft_vocab_size", layer.vocab_size)
    if draft_vocab != layer.vocab_size:
        raise UserError(
            f"{where}: a reduced draft vocabulary ({draft_vocab} of {layer.vocab_size} tokens, t2d/d2t); "
            "this project's drafter drafts over the target's whole vocabulary"
        )
    non_causal = bool(cfg.get("sliding_window_non_causal", variant.speculators_non_causal_default))
    block, causal = int(cfg.get("block_size", 8)), not non_causal
    return layer, [i - 1 for i in aux], block, cfg["mask_token_id"], causal, variant.name, options


def read_drafter_folder(folder: Path) -> DrafterFolder:
    """A z-lab or speculators drafter folder's spec, layer ids and verifier, read as its writer's code
    reads it; ``UserError`` (one line) for what this project's drafter cannot represent."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        if (folder / "drafter_config.json").is_file():
            raise UserError(
                f"{folder} is a dflash-trainer checkpoint, not an export: export it first "
                f"(dflash-train export --format speculators|zlab {folder} OUT), then check OUT"
            )
        raise UserError(f"{folder} is not a drafter folder (no config.json)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{cfg_file} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_file} is not a JSON object")
    check_foreign_config(cfg, cfg_file)
    where, ours = str(folder), (folder / EXPORT_INFO).is_file()
    transforms, scale, verifier = cfg.get("target_transforms") or {}, 1.0, None
    variant, options = "dflash", {}
    if "speculators_model_type" in cfg:
        fmt = "speculators"
        layer, layer_ids, block, mask_id, causal, variant, options = _speculators(cfg, where)
        n_target = -1
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    elif "DFlashDraftModel" in (cfg.get("architectures") or []) or "dflash_config" in cfg:
        fmt = "zlab"
        layer, layer_ids, block, mask_id, causal, n_target, transforms, variant, options = _zlab(cfg, where, ours)
        verifier = (cfg.get("dflash_config") or {}).get("target_model_path")
    else:
        raise UserError(
            f"{cfg_file}: neither a z-lab DFlash drafter (architectures DFlashDraftModel) nor a speculators "
            "one (speculators_model_type dflash)"
        )
    _refuse_unrepresentable_layers(layer, where)
    window = layer.sliding_window  # None when use_sliding_window is false: every layer attends fully
    sliding = tuple(i for i, t in enumerate(layer.layer_types or []) if t == "sliding_attention") if window else ()
    theta, rope_scaling = _rope(layer, where)
    spec = DrafterSpec(
        hidden_size=layer.hidden_size,
        num_heads=layer.num_attention_heads,
        num_kv_heads=getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads,
        head_dim=getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads,
        intermediate_size=layer.intermediate_size,
        vocab_size=layer.vocab_size,
        num_layers=layer.num_hidden_layers,
        num_features=len(layer_ids),
        block_size=block,
        rms_norm_eps=layer.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        sliding_window_layers=sliding,
        sliding_window=window or 2048,
        causal_in_block_sliding=causal,
        mask_token_id=int(mask_id),
        logit_scale=float(transforms.get("logit_scale") or 1.0),
        logit_softcap=transforms.get("logit_softcap"),
        variant=variant,
        variant_options=options,
    )
    n_target = -1 if n_target is None else int(n_target)
    return DrafterFolder(fmt, spec, layer_ids, n_target, cfg, verifier, scale, ours)


def folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors weights, one file or shards listed by the index."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    try:
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            return {k: v for shard in shards for k, v in load_file(str(folder / shard)).items()}
        if (folder / MODEL_WEIGHTS).is_file():
            return load_file(str(folder / MODEL_WEIGHTS))
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise UserError(f"{folder}: its weights cannot be read ({type(exc).__name__}: {exc})") from None
    raise UserError(f"{folder} holds no safetensors weights ({MODEL_WEIGHTS} or {WEIGHTS_INDEX})")


def drafter_state(folder: Path, spec: DrafterSpec) -> dict[str, torch.Tensor]:
    """The drafter's own tensors of a folder (the backbone's and its variant's heads'); other tensors
    it cannot represent are refused."""
    aliases = variant_of(spec).key_aliases
    state = {aliases.get(k, k): v for k, v in folder_weights(folder).items()}
    own = DRAFTER_KEYS + tuple(f"{name}." for name in variant_of(spec).head_names)
    extra = sorted(k for k in state if not k.startswith(own) and k not in IGNORED_KEYS)
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise UserError(f"{folder}: tensors this project's drafter has no place for ({', '.join(extra[:3])}{more})")
    return {k: v for k, v in state.items() if k.startswith(own)}


def folder_meta(d: DrafterFolder) -> dict:
    """The folder in the shape of a checkpoint's metadata (``drafter_config.json``), for eval and speculate."""
    return {
        "format": d.fmt,
        "spec": d.spec.to_dict(),
        "target": {
            "layer_ids": list(d.layer_ids),
            "num_layers": None if d.num_target_layers < 0 else d.num_target_layers,
            "path": d.verifier,
        },
        "step": None,
    }


def check_folder_against_target(d: DrafterFolder, target, where: str) -> None:
    """What only the target decides: z-lab's code reads the target's last layer after the final norm
    (this project hooks it before), in a folder this project did not write (its export refuses that)."""
    if d.fmt == "zlab" and not d.ours and target.num_layers - 1 in d.layer_ids:
        raise UserError(
            f"{where}: z-lab id {target.num_layers - 1} is the target's last layer, which z-lab's code reads "
            "after the final norm (hidden_states[n]); this project's hooks read it before"
        )


def foreign_folder_problems(folder: Path, num_target_layers: int) -> list[str]:
    """``export --check`` of a folder another tool wrote: every refusal, and its weights against its
    config (names and shapes, on the meta device: nothing is allocated)."""
    try:
        d = read_drafter_folder(folder)
        check_folder_against_target(d, SimpleNamespace(num_layers=num_target_layers), str(folder))
        with torch.device("meta"):
            embed = torch.nn.Embedding(d.spec.vocab_size, d.spec.hidden_size)
            drafter = make_drafter(d.spec, embed, embed.weight)
        _load_weights(drafter, folder, assign=True)  # assign: meta parameters take the tensors read
    except UserError as exc:
        return [str(exc)]
    return []


def _load_weights(drafter: DFlashDrafter, folder: Path, assign: bool = False) -> None:
    try:
        drafter.load_state_dict({k: v.float() for k, v in drafter_state(folder, drafter.spec).items()}, assign=assign)
    except RuntimeError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"drafter {folder}: its weights do not fit its config ({' '.join(lines[1:3])[:300]})") from None


def load_drafter_folder(folder: Path, target, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A ``DFlashDrafter`` from a z-lab or speculators drafter folder, for ``target`` (a ``TargetModel``)."""
    from ..drafter_folder import check_against_target

    d = read_drafter_folder(folder)
    check_against_target(d.spec, d.layer_ids, target, f"drafter {folder}")
    check_folder_against_target(d, target, f"drafter {folder}")
    drafter = make_drafter(d.spec, target.embed_tokens, target.lm_head_weight)
    _load_weights(drafter, folder)
    return drafter.to(dtype).eval()


def is_checkpoint(path: Path) -> bool:
    from ..drafter_folder import CONFIG

    return (Path(path) / CONFIG).is_file()


def drafter_meta(path: Path) -> dict:
    """Metadata of a drafter checkpoint, or of a z-lab / speculators drafter folder in the same shape."""
    from ..drafter_folder import CONFIG, WEIGHTS, read_checkpoint_config

    if is_checkpoint(path) or not (Path(path) / "config.json").is_file():
        if not is_checkpoint(path):
            raise UserError(
                f"{path} is not a drafter checkpoint ({CONFIG} and {WEIGHTS}), nor a z-lab or speculators "
                "drafter folder (config.json)"
            )
        return read_checkpoint_config(path)
    return folder_meta(read_drafter_folder(path))


def load_any_drafter(path: Path, target, dtype: torch.dtype = torch.float32) -> tuple[DFlashDrafter, dict]:
    """``(drafter in eval mode, metadata)`` of a checkpoint or a z-lab / speculators drafter folder."""
    from ..drafter_folder import load_drafter

    if is_checkpoint(path):
        return load_drafter(path, target, dtype)
    return load_drafter_folder(path, target, dtype), drafter_meta(path)
