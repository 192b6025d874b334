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
  copied in as ``embed_tokens.weight`` and ``lm_head.weight`` (speculators' loader overwrites both from
  the verifier it names).

Both record ``target_transforms`` (``embedding_scale``, ``logit_scale``, ``logit_softcap``): what the
drafter trained with through the target's own modules (Gemma multiplies embeddings by sqrt(hidden) and
soft-caps logits). The speculators folder stores ``embed_tokens.weight`` with the scale already applied
(``embedding_scale_in_weights``), so a plain lookup gives the rows the drafter trained on; ``--check``
compares the recorded transforms with the target's. The speculators package itself replaces that table
with the verifier's raw one at load, so for targets that scale, the speculators export is a mismatch
(``semantics.mismatches``).


Both also hold ``export_info.json`` (checkpoint, trained layer ids, semantics, accepted mismatches) and
a README.md. What each format means in its serving stack, and what export refuses, is
``semantics.py``; ``check_export`` checks a folder the way its stack reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import load_file, save_file

from ..drafter_folder import WEIGHTS as CKPT_WEIGHTS
from ..drafter_folder import checkpoint_spec, read_checkpoint_config
from ..errors import UserError, check_schema
from ..io import atomic_folder
from ..model.drafter import DFlashDrafter, DrafterSpec
from ..model.loading import resolve_target_path
from ..variants import block_span, make_drafter, variant_of
from .layouts import EXPORT_INFO, MODEL_WEIGHTS, foreign_folder_problems, load_drafter_folder, read_drafter_folder
from .semantics import FORMATS, SEMANTICS, mismatches

EXPORT_INFO_FORMAT = "dflash-trainer-export/1"  # EXPORT_INFO: trained layer ids, checkpoint, semantics, mismatches


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
        "rope_parameters": {"rope_type": "default", **(spec.rope_scaling or {}), "rope_theta": spec.rope_theta},
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
    if spec.rope_scaling:  # transformers 4 and older serving stacks read the scaling from rope_scaling
        cfg["rope_scaling"] = {**spec.rope_scaling, "type": spec.rope_scaling["rope_type"]}
        if spec.rope_scaling["rope_type"] == "yarn":  # the extended context, as transformers checks YaRN's factor
            original = spec.rope_scaling["original_max_position_embeddings"]
            cfg["max_position_embeddings"] = int(round(spec.rope_scaling["factor"] * original))
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


def _verifier_name(fmt: str, target: dict, verifier: str | None) -> str | None:
    """What the export records as the verifier: ``--verifier`` as given (a local folder or a hub name),
    else the checkpoint's target resolved to an absolute local folder ("tiny" is no hub name)."""
    if verifier:
        return str(Path(verifier).resolve()) if Path(verifier).expanduser().is_dir() else verifier
    if target.get("path") is None:
        return None
    try:
        return str(resolve_target_path(target["path"]).resolve())
    except UserError:
        if fmt == "zlab":  # informational there (z-lab's code takes the target as an argument)
            return target["path"]
        raise UserError(
            f"the checkpoint's target {target['path']!r} is not a local folder here: pass --verifier NAME_OR_PATH"
        ) from None


def export_checkpoint(
    checkpoint: Path,
    out_dir: Path,
    fmt: str,
    *,
    target_model=None,
    verifier: str | None = None,
    allow_mismatch: bool = False,
) -> Path:
    """Export ``checkpoint`` as ``fmt`` ("zlab" or "speculators"). The speculators format copies the
    target's embedding and lm_head, so it needs ``target_model`` (a HF causal LM). Settings the format's
    serving stack cannot reproduce (``semantics.mismatches``) are refused unless ``allow_mismatch``,
    which records them in the export's README.md, config.json and export_info.json instead."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}: use 'zlab' or 'speculators'")
    meta = read_checkpoint_config(checkpoint)
    spec = checkpoint_spec(meta)
    variant = variant_of(spec)
    refusal = variant.export_refusal(fmt, spec)
    if refusal:
        raise UserError(f"cannot export as {fmt}: {refusal}")
    target = meta["target"]
    scale = _scale(target_model, target)
    found = mismatches(
        fmt,
        layer_ids=list(target["layer_ids"]),
        num_target_layers=target["num_layers"],
        sliding_window_layers=spec.sliding_window_layers,
        sliding_window=spec.sliding_window,
        causal_in_block_sliding=spec.causal_in_block_sliding,
        embedding_scale=scale,
    )
    if found and not allow_mismatch:
        raise UserError(f"cannot export as {fmt}: " + "; ".join(m.message for m in found) + " (or --allow-mismatch)")
    differs = [m.message for m in found]
    verifier_name = _verifier_name(fmt, target, verifier)
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
                "target_model_path": verifier_name,
                "target_transforms": target_transforms(spec, scale),
            },
        }
        if spec.sliding_window_layers:  # vLLM reads the window's causality here (else: causal on sliding layers)
            config["dflash_config"]["causal"] = spec.causal_in_block_sliding
        config = variant.zlab_config(config, spec)  # DFlash2: DFlash2DraftModel and its four fields
        files: dict[str, object] = {}
        if "auto_map" in config:  # the trust_remote_code model the auto_map names
            modeling = (resources.files("dflash_trainer.export") / "assets" / "modeling_dflash.py").read_text()
            files["modeling_dflash.py"] = modeling
        tensors = state
    else:
        if target_model is None:
            raise UserError("the speculators format copies the target's embedding and lm_head: the target is needed")
        if verifier_name is None:
            raise UserError(
                "the checkpoint names no target path: pass --verifier NAME_OR_PATH (a local folder or hub name)"
            )
        # the drafter looked rows up through the target's module, which scales them (Gemma): bake it in
        # (what a reader of this file gets; speculators itself reloads the raw table: a mismatch above)
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
            # vLLM applies this flag to every draft layer (dflash_config.causal), speculators to the
            # sliding ones only, as trained: without sliding layers it must say non-causal for both.
            "sliding_window_non_causal": not (spec.causal_in_block_sliding and spec.sliding_window_layers),
            "target_transforms": {**target_transforms(spec, scale), "embedding_scale_in_weights": True},
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.block_size - 1}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier_name, "architectures": target["architectures"]},
            },
        }
        config = variant.speculators_config(config, spec)  # DSpark: its model type, heads and draft length
        files = {}
        tensors = {**state, "embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()}
    if differs:
        config["dflash_trainer_mismatches"] = differs
    info = {
        "format": EXPORT_INFO_FORMAT,
        "export_format": fmt,
        "variant": spec.variant,
        "architectures": config["architectures"],
        "checkpoint": str(Path(checkpoint).resolve()),
        "step": meta.get("step"),
        "trained_layer_ids": list(target["layer_ids"]),
        "target": target,
        "verifier": verifier_name,
        "semantics": SEMANTICS[fmt],
        "allowed_mismatches": differs,
    }
    files.update({"config.json": config, EXPORT_INFO: info, "README.md": _export_readme(fmt, info)})
    _write_folder(out_dir, files, tensors)
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


def _export_readme(fmt: str, info: dict) -> str:
    """The export folder's README: how its stack reads it, and what differs from training if anything."""
    step = f" (step {info['step']})" if info["step"] is not None else ""
    lines = [
        f"# DFlash drafter, {fmt} format (written by dflash-trainer)",
        "",
        f"Exported from `{info['checkpoint']}`{step}; trained on target layer ids "
        f"{info['trained_layer_ids']} (z-lab ids: id l = output of decoder layer l, before the final norm).",
        "",
        f"Drafter variant {info['variant']}, architectures {info['architectures']} (the class that loads it).",
        "",
        "How the serving stack reads this export:",
        "",
        *(f"- {key}: {value}" for key, value in info["semantics"].items()),
        "",
    ]
    if info["allowed_mismatches"]:
        lines += [
            "## What differs from training (exported with --allow-mismatch)",
            "",
            *(f"- {line}" for line in info["allowed_mismatches"]),
            "",
        ]
    return "\n".join(lines)


def read_export(folder: Path) -> tuple[str, DrafterSpec, list[int], int, dict]:
    """``(format, spec, z-lab layer ids, target layer count or -1, config)`` of a drafter folder in
    either layout, whoever wrote it (``layouts.read_drafter_folder``)."""
    d = read_drafter_folder(folder)
    return d.fmt, d.spec, d.layer_ids, d.num_target_layers, d.config


def load_export(folder: Path, target, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A ``DFlashDrafter`` from a drafter folder of either layout, for ``target`` (a ``TargetModel``)."""
    return load_drafter_folder(folder, target, dtype)


class _ExportInfo(BaseModel):
    """The fields of ``export_info.json`` the check reads (strict JSON types; the rest kept)."""

    model_config = ConfigDict(strict=True, extra="allow")
    trained_layer_ids: list[int]
    checkpoint: str | None = None
    step: int | None = None
    allowed_mismatches: list[str] = []


def read_export_info(folder: Path) -> dict | None:
    """The export's ``export_info.json`` (trained layer ids, checkpoint, allowed mismatches), or None."""
    f = Path(folder) / EXPORT_INFO
    if not f.is_file():
        return None
    try:
        info = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{f} is unreadable or corrupt ({exc}): export the drafter again") from None
    check_schema(_ExportInfo, info, str(f), "export the drafter again")
    return info


def recorded_verifier(fmt: str, cfg: dict) -> str | None:
    """The target an export names: speculators' verifier, or the zlab config's target_model_path."""
    if fmt == "zlab":
        return (cfg.get("dflash_config") or {}).get("target_model_path")
    return ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def resolve_verifier(name: str) -> Path:
    """The local folder of ``name`` resolved the way speculators' ``from_pretrained`` resolves its
    verifier: an existing local folder, else a Hugging Face hub id (downloaded, or from the cache when
    offline). One-line ``UserError`` when the stack could not load it."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise UserError(f"verifier {name} is a folder without config.json: not a model folder")
        if not any(folder.glob("*.safetensors")):
            raise UserError(f"verifier {name} has no *.safetensors: speculators loads its embedding from those")
        return folder
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id=name, filename="config.json")).parent
    except Exception as exc:  # noqa: BLE001 - any failure here is "the stack cannot load it"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"verifier {name!r} is neither a local model folder nor loadable from the Hugging Face hub "
            f"({first}); re-export with --verifier NAME_OR_PATH"
        ) from None


def expected_tensors(fmt: str, spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an export of ``spec`` must hold, with its shape (built on the meta device)."""
    with torch.device("meta"):
        embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
        drafter = make_drafter(spec, embed, embed.weight)
    shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    if fmt == "speculators":
        shapes["embed_tokens.weight"] = shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def zlab_features(model, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """``[L] -> [L, k*H]`` context features as z-lab's code extracts them: transformers'
    ``hidden_states[l + 1]`` (after the final norm for the last layer), concatenated in id order."""
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


SMOKE_TOLERANCE = 1e-3  # max |logit difference|: export vs checkpoint (bf16-rounded), both computed in fp32
SMOKE_ANCHORS = 4  # blocks per row
SMOKE_ROWS = 2  # held-out rows of the tiny target's corpus (stdlib source), at most SMOKE_TOKENS each
SMOKE_TOKENS = 160


@dataclass
class CheckReport:
    """``problems`` fail the check; ``notes`` are what was measured or accepted at export."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    max_logit_diff: float | None = None


def _tensor_problems(folder: Path, fmt: str, spec: DrafterSpec) -> list[str]:
    from safetensors import safe_open

    expected = expected_tensors(fmt, spec)
    problems = []
    with safe_open(str(Path(folder) / MODEL_WEIGHTS), framework="pt") as f:
        present = set(f.keys())
        for name in sorted(expected.keys() - present):
            problems.append(f"weights have no {name} (expected {expected[name]})")
        for name in sorted(present - expected.keys()):
            problems.append(f"weights hold {name}, which the config does not describe")
        for name in sorted(present & expected.keys()):
            sl = f.get_slice(name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if shape != expected[name]:
                hint = ""
                if name == "fc.weight" and len(shape) == 2 and shape[1] % spec.hidden_size == 0:
                    hint = f" ({shape[1] // spec.hidden_size} layers x hidden; the config has {spec.num_features} layer ids)"
                problems.append(f"{name} is {shape}, the config gives {expected[name]}{hint}")
            if dtype != "BF16":
                problems.append(f"{name} is {dtype}, the config says bfloat16")
    return problems


def check_export(
    folder: Path, target_path: str | None = None, checkpoint: str | None = None, *, smoke: bool = True
) -> CheckReport:
    """Check an exported folder: its config against the target, every tensor's shape and dtype, the
    layer ids against those it was trained with, the semantics its stack applies, the verifier resolved
    as the stack would, and (``smoke``) block logits on real rows against the checkpoint's."""
    from transformers import AutoConfig, AutoTokenizer

    from ..model.target import config_embedding_scale, text_config

    fmt, spec, layer_ids, n_target, cfg = read_export(folder)
    info = read_export_info(folder)
    report = CheckReport()
    problems, notes = report.problems, report.notes
    named = recorded_verifier(fmt, cfg)
    verifier_dir = None
    if named:
        try:
            verifier_dir = resolve_verifier(named)
        except UserError as exc:
            if fmt == "speculators":  # speculators' from_pretrained loads it; z-lab's code never reads it
                problems.append(str(exc))
    elif fmt == "speculators":
        problems.append("speculators_config.verifier.name_or_path is empty: re-export with --verifier NAME_OR_PATH")
    tdir = resolve_target_path(target_path) if target_path else verifier_dir
    if tdir is None:
        problems.append("the export names no loadable target; pass --target PATH")
        return report
    tcfg = text_config(AutoConfig.from_pretrained(tdir, local_files_only=True))
    if spec.hidden_size != tcfg.hidden_size:
        problems.append(f"hidden size {spec.hidden_size} does not match the target's {tcfg.hidden_size}")
    if spec.vocab_size != tcfg.vocab_size:
        problems.append(f"vocabulary {spec.vocab_size} does not match the target's {tcfg.vocab_size}")
    n_layers = tcfg.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        hint = " (speculators ids are z-lab ids + 1: an off-by-one export?)" if fmt == "speculators" else ""
        problems.append(f"target layer ids {bad} are outside the target's 0..{n_layers - 1}{hint}")
    if info is None:  # written by speculators, z-lab or another trainer: checked as its stack reads it
        notes.append(
            f"not written by dflash-trainer (no {EXPORT_INFO}): the layer ids it was trained with and a "
            "checkpoint to compare its logits with are not known; checked as its serving stack reads it"
        )
    elif list(layer_ids) != list(info["trained_layer_ids"]):
        shown = [i + 1 for i in layer_ids] if fmt == "speculators" else list(layer_ids)
        want = [i + 1 for i in info["trained_layer_ids"]] if fmt == "speculators" else info["trained_layer_ids"]
        key = "aux_hidden_state_layer_ids" if fmt == "speculators" else "dflash_config.target_layer_ids"
        problems.append(f"{key} {shown} are not the ids the drafter was trained with ({want})")
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
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        tokens, drafts = methods[0].get("speculative_tokens"), block_span(spec) - 1
        if tokens != drafts:
            what = "block_size - 1" if drafts == spec.block_size - 1 else "block_size (sample_from_anchor)"
            problems.append(f"speculative_tokens {tokens} does not equal {what} = {drafts}")
    if info is None:  # the weights against the config, and what only the target's layer count decides
        problems.extend(foreign_folder_problems(folder, n_layers))
    else:
        problems.extend(_tensor_problems(folder, fmt, spec))
    allowed = set((info or {}).get("allowed_mismatches", []))
    for m in mismatches(
        fmt,
        layer_ids=layer_ids,
        num_target_layers=n_layers,
        sliding_window_layers=spec.sliding_window_layers,
        sliding_window=spec.sliding_window,
        causal_in_block_sliding=spec.causal_in_block_sliding,
        embedding_scale=config_embedding_scale(tcfg),
    ):
        (notes if m.message in allowed else problems).append(
            f"{'accepted at export: ' if m.message in allowed else ''}{m.message}"
        )
    if smoke and not problems and info is not None:
        _smoke_test(folder, fmt, spec, layer_ids, info, tdir, checkpoint, report, tolerate=bool(allowed))
    return report


def _draft_logits(drafter, hidden: torch.Tensor, anchor: int) -> torch.Tensor:
    """``[D, V]``: the raw logits a block's drafts are read from (``Variant.draft_logits``: DFlash's
    slots 1..B-1; DSpark's Markov walk, each slot biased by the draft before it; DFlash2's selector
    walk, -inf outside each slot's K candidates)."""
    anchors = torch.tensor([anchor], device=hidden.device)
    return variant_of(drafter.spec).draft_logits(drafter, hidden[None], anchors, None)[0]


def compare_draft_logits(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    """``[D, V]`` each -> (max |diff| over the entries finite in both, slots whose finite entries are
    not the same set: a selector's other candidates). -inf minus -inf is no difference, and a NaN
    anywhere is an infinite one (Python's ``max`` would drop it silently)."""
    finite_got, finite_want = torch.isfinite(got), torch.isfinite(want)
    other = int((finite_got != finite_want).any(-1).sum())
    both = finite_got & finite_want
    worst = (got - want)[both].abs().max().item() if both.any() else 0.0
    if got.isnan().any() or want.isnan().any():
        worst = float("inf")
    return worst, other


def _smoke_test(folder, fmt, spec, layer_ids, info, tdir, checkpoint, report: CheckReport, tolerate: bool) -> None:
    """Block logits of the export (its weights read back, features extracted as its stack extracts them)
    against the checkpoint's (weights rounded to bf16 as exported), on real rows, in fp32."""
    from ..config import TargetConfig
    from ..drafter_folder import load_drafter
    from ..model.loading import load_target
    from ..model.target import TargetModel
    from ..tiny_target.corpus import load_split

    ckpt = Path(checkpoint or (info or {}).get("checkpoint") or "")
    if not (ckpt / CKPT_WEIGHTS).is_file():
        report.problems.append(f"checkpoint {ckpt} is not there for the numeric check: pass --checkpoint PATH")
        return
    model, tok, _ = load_target(TargetConfig(path=str(tdir), dtype="float32"))
    trained = TargetModel(model, layer_ids=info["trained_layer_ids"])
    reference, _ = load_drafter(ckpt, trained)
    for p in reference.parameters():
        p.data = p.data.bfloat16().float()
    served = TargetModel(model, layer_ids=layer_ids)
    exported = load_export(folder, served)
    worst, agree, total, other = 0.0, 0, 0, 0
    for doc in load_split("held_out", limit=SMOKE_ROWS):
        ids = torch.tensor(tok(doc.text, add_special_tokens=False)["input_ids"][:SMOKE_TOKENS])
        if ids.numel() < spec.block_size + 2:
            continue
        ref_feats = trained.features(ids, need_teacher=False).context
        exp_feats = (
            zlab_features(model, ids, layer_ids) if fmt == "zlab" else served.features(ids, need_teacher=False).context
        )
        last = ids.numel() - spec.block_size
        for a in torch.linspace(1, last, SMOKE_ANCHORS).long().tolist():
            pos = torch.arange(a)
            want = _draft_logits(
                reference,
                reference.draft_block(int(ids[a]), a, reference.context_cache(ref_feats[:a], pos)),
                int(ids[a]),
            )
            got = _draft_logits(
                exported, exported.draft_block(int(ids[a]), a, exported.context_cache(exp_feats[:a], pos)), int(ids[a])
            )
            diff, differ = compare_draft_logits(got, want)
            worst, other = max(worst, diff), other + differ
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += got.shape[0]
    report.max_logit_diff = worst
    line = (
        f"block logits vs checkpoint {ckpt.name}: max |diff| {worst:.2e} (tolerance {SMOKE_TOLERANCE:g}), "
        f"top-1 agreement {agree}/{total} draft slots"
    )
    if other:  # DFlash2: the selector scores other candidates than the checkpoint's (selector_top_k?)
        line += f", {other}/{total} slots with other candidates than the checkpoint's"
    if worst <= SMOKE_TOLERANCE and not other:
        report.notes.append(line)
    elif tolerate:
        report.notes.append(line + " (the accepted mismatches above)")
    else:
        report.problems.append(line)
