"""Training from the feature cache (``features/``): the drafter side of a step, with no target body.

``CachedFeed`` stands where ``distributed.DrafterFeed`` stands for a drafter rank fed by target ranks:
the trainer asks it for global row ``g`` and gets the same ``RowFeatures`` the target would have
produced, because everything random stays a function of ``(train.seed, g)``: the row (the epoch order
of ``RowStream``), its anchors (``step.row_anchors``) and the drafter's feature noise (``step.row_rng``).
With features stored in the target's dtype an offline run is bit-identical to the online run of the
same config. ``cache_mismatches`` is the check that a cache belongs to the run, made before training.
"""

from __future__ import annotations

import time

import torch

from ..config import RunConfig
from ..data.prepare import changed_inputs, request_for, setting_differences
from ..features.store import FeatureStore
from ..features.window import release_shards
from ..model.target import TargetFeatures, default_layer_ids, select_row_features
from .distributed import Layout, StepPlan
from .step import needs_teacher, row_anchors


def run_layer_ids(cfg: RunConfig, num_layers: int) -> list[int]:
    """The target layer ids a run hooks: ``target.layer_ids`` or the default rule."""
    if cfg.target.layer_ids is not None:
        return list(cfg.target.layer_ids)
    return default_layer_ids(num_layers, cfg.target.num_feature_layers)


def cache_mismatches(cfg: RunConfig, store: FeatureStore, identity: dict, tokenizer) -> list[str]:
    """Why ``store`` cannot feed this run, in words (empty: it can). ``identity``: ``loading.target_identity``
    of the run's target (its embedding and head, read for the drafter anyway)."""
    have, out = store.manifest, []
    captured = have["target"]
    for key in ("architectures", "num_layers", "hidden_size", "vocab_size", "dtype", "config_sha256"):
        if captured.get(key) != identity.get(key):
            what = "config.json" if key == "config_sha256" else key
            out.append(
                f"other target: captured from {captured.get('path')} with {what} {captured.get(key)!r}, "
                f"this run's target has {identity.get(key)!r}"
            )
    if captured.get("embedding_and_head_sha256") != identity.get("embedding_and_head_sha256"):
        out.append(
            f"other target: the embedding or head of {identity.get('path')} differ from those it was captured with"
        )
    ids = run_layer_ids(cfg, identity["num_layers"])
    if have["settings"]["layer_ids"] != ids:
        out.append(f"other layer ids: captured {have['settings']['layer_ids']}, this run hooks {ids}")
    if needs_teacher(cfg) and not have["settings"]["teacher"]:
        out.append(
            "the loss needs the teacher (soft KL or teacher labels) and the cache holds no last hidden states: "
            "capture with capture.teacher=true"
        )
    request = request_for(cfg.data, tokenizer, identity["vocab_size"], min_tokens=cfg.drafter.block_span + 1)
    data = have["data"]
    with_inputs = bool(cfg.data.train_files)
    out += [f"other data: {p}" for p in setting_differences(data, request, with_inputs=with_inputs)]
    if with_inputs:
        out += [f"other data: {p}" for p in changed_inputs(data)]
    want_eval = min(cfg.data.max_eval_rows, data["eval_rows_total"])
    if have["splits"]["eval"] < want_eval:
        out.append(
            f"data.max_eval_rows {cfg.data.max_eval_rows} asks for {want_eval} held-out rows, the cache holds "
            f"{have['splits']['eval']}: capture with this data.max_eval_rows"
        )
    return out


class CachedEvalFeatures:
    """``target.features`` for the evaluation's held-out rows, read from the cache: the row is found by
    its token ids, searching forward from the last one served (the scorer asks in row order)."""

    def __init__(self, store: FeatureStore, dtype: torch.dtype, device: torch.device):
        self.store, self.dtype, self.device = store, dtype, device
        self.rows = store.rows("eval")
        self.next = 0

    def features(self, input_ids, position_ids=None, need_teacher=True) -> TargetFeatures:
        n = len(self.rows)
        for step in range(n):
            i = (self.next + step) % n
            if torch.equal(self.rows[i].input_ids, input_ids.to("cpu")):
                self.next = i + 1
                f = self.store.features("eval", i, self.dtype, need_teacher=True)
                return TargetFeatures(f.context.to(self.device), f.last_hidden.to(self.device))
        raise RuntimeError("a held-out row the evaluation scores is not in the feature cache")


class CachedFeed:
    """A drafter rank's micro-batches read from the feature cache (the ``DrafterFeed`` interface)."""

    def __init__(
        self,
        cfg: RunConfig,
        store: FeatureStore,
        stream,
        layout: Layout,
        device: torch.device,
        dtype: torch.dtype,
        *,
        rows_consumed: int = 0,
    ):
        self.cfg, self.store, self.stream, self.layout = cfg, store, stream, layout
        self.device, self.dtype = device, dtype
        self.rows = store.rows("train")
        self.plan = StepPlan(stream, len(self.rows), cfg.drafter.block_span, cfg.train.grad_accum, start=rows_consumed)
        self.read_s, self.bytes_read = 0.0, 0

    def take(self, g: int):
        """``RowFeatures`` of global row ``g``, as ``step.produce_row_features`` makes them online."""
        r = self.stream.row_index(g)
        t0 = time.monotonic()
        row = self.rows[r]
        anchors = row_anchors(row, g, self.cfg)
        teacher = needs_teacher(self.cfg)
        feats = self.store.features("train", r, self.dtype, need_teacher=teacher)
        self.read_s += time.monotonic() - t0
        self.bytes_read += sum(
            t.numel() * t.element_size() for t in (feats.context, feats.last_hidden) if t is not None
        )
        dev = self.device
        feats = TargetFeatures(feats.context.to(dev), feats.last_hidden.to(dev) if teacher else None)
        ids, pos, mask, anchors = (t.to(dev) for t in (row.input_ids, row.position_ids, row.loss_mask, anchors))
        return select_row_features(feats, ids, pos, mask, anchors, self.cfg.drafter.block_span, teacher)

    def eval_features(self) -> CachedEvalFeatures:
        return CachedEvalFeatures(self.store, self.dtype, self.device)

    def end_step(self) -> None:
        pass

    def checkpointed(self, rows_consumed: int) -> None:
        """A checkpoint at ``rows_consumed`` was written: with a window, the training shards wholly before
        it are released (a resume from it never reads them), in the first pass over the data."""
        window = self.cfg.data.feature_window
        if window and rows_consumed <= len(self.rows):
            release_shards(
                self.store.folder, rows_consumed // self.store.rows_per_shard, self.cfg.data.feature_window_keep
            )

    def metrics(self, elapsed: float) -> dict:
        return {"cache_read_s": self.read_s, "cache_read_bytes_per_s": self.bytes_read / max(elapsed, 1e-9)}

    @staticmethod
    def postfix(record: dict) -> dict:
        return {"read": f"{record['cache_read_s']:.0f}s", "MB_s": f"{record['cache_read_bytes_per_s'] / 1e6:.1f}"}

    def peer_error(self) -> None:
        return None
