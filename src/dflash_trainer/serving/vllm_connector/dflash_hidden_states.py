"""A vLLM KV connector that writes each request's hidden states to one file as soon as its prompt
has run: the connector of ``dflash-train capture --engine vllm`` (imported by vLLM, in vLLM's own
environment; nothing of this package is imported here).

vLLM's ``extract_hidden_states`` speculative method stores the target's auxiliary hidden states
(``eagle_aux_hidden_state_layer_ids``, Hugging Face ``hidden_states`` indices: 0 is the embedding,
``i`` the output of decoder layer ``i - 1``, before the final norm) of every scheduled token in a
cache-only attention layer's paged cache, ``[blocks, layers, block_size, hidden]``. This connector
copies a request's rows out of that cache on the worker of tensor-parallel rank 0, in the step whose
forward completes the request's prompt, and writes them to ``{shared_storage_path}/{request
id}.safetensors``: ``hidden_states`` ``[prompt tokens, layers, hidden]`` and ``token_ids``
``[prompt tokens]``. The file is complete (written under a temporary name, then renamed) before the
step's sampled token reaches the client, so a client that has its output can read the file at once.

Why not vLLM's ``ExampleHiddenStatesConnector``: it copies on a CUDA stream into pinned memory and
writes from a thread after the request has finished (clients wait on a file lock), which the CPU
build cannot run (no CUDA streams or events there; the file is never written). This one copies
synchronously on any device: a slower step on a GPU, and one mechanism everywhere.

Loaded with ``kv_transfer_config={"kv_connector": "DflashHiddenStatesConnector",
"kv_connector_module_path": "dflash_hidden_states", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR}}`` and this file's folder on the Python path (PYTHONPATH=.../serving/vllm_connector).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


@dataclass
class _Save:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class _Metadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)  # prompts completed by this step's forward


def _hidden_state_group(kv_cache_config) -> int:
    """Index of the KV cache group of the cache-only layer that holds the hidden states."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(f"no single hidden-states KV cache group among {len(groups)} groups")


class DflashHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._dir = self._kv_transfer_config.get_from_extra_config("shared_storage_path", None)
        if not self._dir:
            raise ValueError("kv_connector_extra_config.shared_storage_path is required: where the files go")
        self._group = _hidden_state_group(kv_cache_config)
        self._open: dict[str, _Save] = {}  # scheduler side: prompts still running, blocks so far
        self._cache: torch.Tensor | None = None  # worker side: the cache-only layer's paged cache
        self._writer = True  # worker side: tensor-parallel rank 0 only

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False  # store only: nothing is ever loaded

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = _Metadata()
        scheduled = scheduler_output.num_scheduled_tokens
        running = []
        for new in scheduler_output.scheduled_new_reqs:
            path = os.path.join(self._dir, f"{new.req_id}.safetensors")
            self._open[new.req_id] = _Save(new.req_id, path, list(new.prompt_token_ids), [])
            running.append((new.req_id, new.block_ids, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._open:
                running.append((req_id, cached.new_block_ids[i], cached.num_computed_tokens[i]))
        for req_id, block_ids, computed in running:
            save = self._open[req_id]
            if block_ids is not None:
                save.block_ids += list(block_ids[self._group])
            if computed + scheduled.get(req_id, 0) >= len(save.token_ids):  # the prompt's last chunk runs now
                meta.saves.append(self._open.pop(req_id))
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._open.pop(request.request_id, None)
        return False, {"hidden_states_path": os.path.join(self._dir, f"{request.request_id}.safetensors")}

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writer = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ValueError(f"expected one cache-only layer (extract_hidden_states), found {len(layers)}")
        self._cache = kv_caches[next(iter(layers))]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # the rows are read in wait_for_save, after the drafter's (cache-only) forward wrote them

    def wait_for_save(self) -> None:
        """Write the files of the prompts this step completed: the rows of their slots, in token order."""
        if not self._writer or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        cache = self._cache  # [blocks, layers, block_size, hidden]
        block_size = cache.shape[2]
        for save in meta.saves:
            n = len(save.token_ids)
            slots = (
                torch.tensor(save.block_ids, dtype=torch.long)[:, None] * block_size + torch.arange(block_size)
            ).flatten()[:n]
            slots = slots.to(cache.device)
            rows = cache[slots // block_size, :, slots % block_size].to("cpu")  # [n, layers, hidden]
            tensors = {"hidden_states": rows.contiguous(), "token_ids": torch.tensor(save.token_ids)}
            os.makedirs(os.path.dirname(save.path), exist_ok=True)
            tmp = save.path + ".partial"
            save_file(tensors, tmp)
            os.replace(tmp, save.path)

    def get_finished(self, finished_req_ids):
        return None, None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None
