"""Hidden states of token-id prompts from vLLM (``extract_hidden_states`` with this project's
connector, ``vllm_connector/dflash_hidden_states.py``): from one ``vllm.LLM`` in a subprocess of the
python that has vLLM (``VllmExtractor``), or from running servers started with ``server_command``
(``ServerExtractor``; their files must be readable here: the same machine or a shared filesystem).

Both answer ``extract(prompts)`` with one safetensors file per prompt: ``hidden_states`` ``[tokens,
len(hf_ids), H]`` at the Hugging Face ``hidden_states`` indices ``hf_ids`` (0: the embedding, ``i``: the
output of decoder layer ``i - 1`` before the final norm), ``token_ids`` ``[tokens]``.
"""

from __future__ import annotations

import json
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..errors import UserError
from .engines import RunnerProcess, ServerEngine
from .launch import ENV_PYTHON, RUNNER, vllm_env, vllm_python

CONNECTOR_DIR = RUNNER.parent / "vllm_connector"
CONNECTOR = {"kv_connector": "DflashHiddenStatesConnector", "kv_connector_module_path": "dflash_hidden_states"}


def extraction_args(hf_ids: list[int], folder: Path) -> dict:
    """The ``vllm.LLM`` / server arguments that make vLLM an extractor: the ``extract_hidden_states``
    method at ``hf_ids``, this project's connector writing to ``folder``, and prefix caching off (a
    cached prefix would skip its forward, and its states with it). One source for the subprocess
    engine and the printed server command."""
    return {
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(hf_ids)}},
        },
        "kv_transfer_config": {
            **CONNECTOR,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(Path(folder).resolve())},
        },
    }


def _flag(name: str, value) -> str:
    """One ``vllm serve`` flag from a ``vllm.LLM`` keyword: booleans as ``--x`` / ``--no-x``."""
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag}={json.dumps(value) if isinstance(value, (dict, list)) else value}"


def server_command(target: Path, hf_ids: list[int], folder: Path, engine_args: dict) -> str:
    """The shell command that starts a vLLM server ``--server URL`` can capture from: ``extraction_args``
    and ``engine_args`` as flags. vLLM's OpenAI server module rather than ``vllm serve`` (the same
    flags): the CPU build's ``vllm`` script looks up a package named vllm and fails; the python is
    ``DFLASH_VLLM_PYTHON``'s, else ``python``."""
    flags = [_flag(k, v) for k, v in {**extraction_args(hf_ids, folder), **engine_args}.items()]
    return " ".join(
        [
            f"PYTHONPATH={shlex.quote(str(CONNECTOR_DIR))}",
            shlex.quote(os.environ.get(ENV_PYTHON) or "python"),
            "-m vllm.entrypoints.openai.api_server --model",
            shlex.quote(str(target)),
            *map(shlex.quote, flags),
        ]
    )


class VllmExtractor(RunnerProcess):
    """One ``vllm.LLM`` of ``target`` extracting at ``hf_ids`` into ``folder``, in a subprocess
    (``vllm_runner.py --extract``) fed prompt batches over its stdin."""

    def __init__(self, target: Path, hf_ids: list[int], folder: Path, engine_args: dict, *, python=None, env=None):
        python = Path(python or vllm_python())
        options = {**extraction_args(hf_ids, folder), **engine_args}
        cmd = [str(python), str(RUNNER), "--extract", str(Path(target).resolve()), json.dumps(options)]
        run_env = vllm_env(python)
        run_env["PYTHONPATH"] = str(CONNECTOR_DIR)  # vLLM (its worker processes too) imports the connector
        super().__init__(cmd, {**run_env, **(env or {})})

    def extract(self, prompts: list[list[int]]) -> list[Path]:
        return [Path(p) for p in self.ask({"prompts": prompts})["files"]]


class _Extracted(BaseModel):
    """The part of a ``/v1/completions`` answer this client reads."""

    model_config = ConfigDict(extra="allow")
    kv_transfer_params: dict | None = None


class ServerExtractor:
    """Running vLLM servers started with ``server_command``: each prompt one completion request of one
    token, the file's path read from the answer's ``kv_transfer_params``; prompts go to the servers in
    turn, several at once."""

    def __init__(self, urls: list[str], concurrency: int = 16):
        self.servers = [ServerEngine(url) for url in urls]
        self.concurrency = concurrency

    def _one(self, job) -> Path:
        i, ids = job
        server = self.servers[i % len(self.servers)]
        body = {"model": server.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        answer = server._request("/v1/completions", _Extracted, body)
        path = (answer.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise UserError(
                f"the server at {server.url} names no hidden-states file in its answer: start it with the command "
                "`dflash-train capture --engine vllm --print-server-command` prints"
            )
        return Path(path)

    def extract(self, prompts: list[list[int]]) -> list[Path]:
        with ThreadPoolExecutor(max(1, min(self.concurrency * len(self.servers), len(prompts)))) as pool:
            return list(pool.map(self._one, enumerate(prompts)))

    def close(self) -> None:
        pass
