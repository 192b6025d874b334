"""Target features of packed rows from hidden states vLLM extracted (``serving.hidden_states``): the
same ``TargetFeatures`` the in-process target returns, so ``capture --engine vllm`` writes the same
feature cache.

Layer numbering, the known trap: this project's layer id ``l`` is the output of decoder layer ``l``
(z-lab's convention); vLLM's ``eagle_aux_hidden_state_layer_ids`` are Hugging Face ``hidden_states``
indices, where 0 is the embedding, so id ``l`` is vLLM's ``l + 1`` (``hf_index``). Capturing at ``l``
instead reads the layer below, and the drafter trained on it caps its acceptance.

The teacher (the final-normed last hidden state): vLLM's auxiliary states are taken before the final
norm, so the last layer's output (``hidden_states[num_layers]``) is extracted and the target's own
final norm module (``loading.load_target_head(..., final_norm=True)``) is applied here.

Each document of a row is one request (every document starts at position 0 and attends only to
itself: what the in-process target computes of a packed row); the padding tail is a document too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..data.packing import PackedRow, document_spans
from ..errors import UserError
from ..model.target import TargetFeatures, TargetModel


def hf_index(layer_id: int) -> int:
    """vLLM's (Hugging Face ``hidden_states``) index of this project's layer id: one more."""
    return layer_id + 1


def extraction_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """vLLM's indices to extract for these layer ids, sorted, with ``num_layers`` (the last layer's
    output before the final norm, which the teacher is computed from)."""
    return sorted({hf_index(i) for i in layer_ids} | {num_layers})


class VllmFeatures:
    """Features of packed rows from an extractor (``serving.hidden_states``), for ``target``: a
    ``TargetModel`` with the final norm loaded (head-only is enough: no body runs here)."""

    def __init__(self, extractor, target: TargetModel):
        self.extractor = extractor
        self.layer_ids = list(target.layer_ids)
        self.norm = target.body.norm
        self.dtype = target.embed_tokens.weight.dtype
        self.last = target.num_layers  # hidden_states[num_layers]: the last layer's output, before the norm
        self.hf_ids = extraction_ids(self.layer_ids, self.last)

    def features_of(self, rows: Sequence[PackedRow], need_teacher: bool) -> list[TargetFeatures]:
        """One ``TargetFeatures`` per row (``context`` ``[L, k*H]``, ``last_hidden`` ``[L, H]`` or None),
        from one extraction call for all their documents."""
        spans = [document_spans(row.position_ids) for row in rows]
        prompts = [row.input_ids[s:e].tolist() for row, doc in zip(rows, spans) for s, e in doc]
        files = iter(self.extractor.extract(prompts))
        where = {h: i for i, h in enumerate(self.hf_ids)}
        pick = [where[hf_index(i)] for i in self.layer_ids]
        out = []
        for row, doc in zip(rows, spans):
            states = [self._read(next(files), row.input_ids[s:e]) for s, e in doc]  # [n, len(hf_ids), H] each
            h = torch.cat(states)
            context = h[:, pick].reshape(h.shape[0], -1).to(self.dtype)
            last_hidden = None
            if need_teacher:
                with torch.no_grad():
                    last_hidden = self.norm(h[:, where[self.last]].to(self.dtype))
            out.append(TargetFeatures(context, last_hidden))
        return out

    def _read(self, path: Path, token_ids: torch.Tensor) -> torch.Tensor:
        try:
            data = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise UserError(f"cannot read vLLM's hidden states {path}: {exc}") from None
        path.unlink()  # read once; the scratch folder stays small
        got = data.get("token_ids")
        if got is None or not torch.equal(got.long(), token_ids.long()):
            raise UserError(f"vLLM's hidden states {path} are of other tokens than the prompt sent")
        states = data["hidden_states"]
        if states.shape[:2] != (len(token_ids), len(self.hf_ids)):
            raise UserError(
                f"vLLM's hidden states {path} have shape {tuple(states.shape)}, expected "
                f"[{len(token_ids)}, {len(self.hf_ids)}, H]: was the server started for layers {self.hf_ids}?"
            )
        return states

    def close(self) -> None:
        self.extractor.close()
