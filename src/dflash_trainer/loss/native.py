"""The CPU kernel for a chunk's element-wise work: build once per machine, load, call on row ranges.

``kernels/chunk_epilogue.cpp`` is plain C++ (no torch headers): the system's C++ compiler builds it in
a few seconds into a shared library cached on disk, keyed by the source, the compiler and the CPU
(it is built with ``-march=native`` where the compiler takes it; the ranks of one launch build it
once between them); ``ctypes`` loads it. A chunk's rows are split across ``torch.get_num_threads()``
threads: OpenMP's inside the kernel (built with ``-fopenmp``, it binds to the ``libgomp`` torch has
loaded, so both share one thread pool instead of competing for the cores), or, where the compiler has
no OpenMP, Python threads (a ``ctypes`` call releases the GIL).

Two builds of the same source: ``native`` (the default: ``-march=native``, every vector extension of
this CPU, AVX-512 or AVX2 or NEON) and ``baseline`` (the architecture's baseline instruction set,
``-march=x86-64`` on x86-64: SSE2 only; ``-march=armv8-a`` on AArch64), which the tests run beside the
native one so that a machine without AVX-512 is exercised on every machine. ``DFLASH_KERNEL_ISA``
picks the build the loss loads (``native`` or ``baseline``); a compiler that refuses ``-march`` builds
for its own default target instead.

``DFLASH_KERNEL_CACHE`` sets the cache folder (default ``~/.cache/dflash-trainer/kernels``), ``CXX``
the compiler (default ``c++``). ``load()`` returns None, and ``BUILD_ERROR`` says why, where the
kernel cannot be built; the loss then uses another implementation.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "chunk_epilogue.cpp"
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp-simd", "-std=c++17", "-fPIC", "-shared")
_BASELINE_ARCH = {
    "x86_64": "-march=x86-64",
    "AMD64": "-march=x86-64",
    "aarch64": "-march=armv8-a",
    "arm64": "-march=armv8-a",
}
_baseline = _BASELINE_ARCH.get(platform.machine())
# Per build, tried in order: a compiler without OpenMP builds the kernel single-threaded (Python threads
# split the rows), one without the -march flag (some clang targets) for its own default target.
OPTIONAL_FLAGS = {
    "native": (("-march=native", "-fopenmp"), ("-march=native",), ()),
    "baseline": (((_baseline, "-fopenmp"), (_baseline,), ("-fopenmp",), ()) if _baseline else (("-fopenmp",), ())),
}
ISAS = tuple(OPTIONAL_FLAGS)
ISA_ENV = "DFLASH_KERNEL_ISA"
CACHE_ENV = "DFLASH_KERNEL_CACHE"
# Head dtype -> (entry point, compute dtype of the row results).
ENTRY = {
    torch.bfloat16: ("dflash_chunk_bf16", torch.float32),
    torch.float32: ("dflash_chunk_f32", torch.float32),
    torch.float64: ("dflash_chunk_f64", torch.float64),
}

# what building took in this process (None: loaded from the cache, or built by another process)
BUILD_SECONDS: float | None = None
BUILD_ERROR: str | None = None
_libraries: dict[str, ctypes.CDLL | None] = {}  # per build, once tried (None: it could not be built)
_errors: dict[str, str] = {}
_pool: ThreadPoolExecutor | None = None


def selected_isa() -> str:
    """The build the loss uses: ``DFLASH_KERNEL_ISA`` (``native``, the default, or ``baseline``)."""
    isa = os.environ.get(ISA_ENV, "native") or "native"
    if isa not in OPTIONAL_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISAS)}")
    return isa


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the architecture and, on Linux, the CPU's model and flags."""
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                parts.append(line)
                if len(parts) >= 3:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def library_path(isa: str | None = None) -> Path:
    """Where the ``isa`` build (default: the selected one) for this source, compiler and CPU lives."""
    isa = isa or selected_isa()
    cxx = os.environ.get("CXX", "c++")
    key = hashlib.sha256(
        "\n".join(
            [SOURCE.read_text(), _compiler_version(cxx), repr((FLAGS, OPTIONAL_FLAGS[isa])), _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    return _cache_root() / f"chunk_epilogue-{isa}-{key}.so"


def _cache_root() -> Path:
    """``DFLASH_KERNEL_CACHE``, else ``~/.cache/dflash-trainer/kernels``, else (a read-only home) a temp folder."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    home = Path.home() / ".cache" / "dflash-trainer" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"dflash-trainer-kernels-{os.getuid()}"


def _build(target: Path, isa: str) -> bool:
    """Compile ``target`` unless another process has meanwhile (True: this one compiled it). The ranks of
    one launch that all find the cache empty take turns on a lock file next to it, so one of them
    compiles (5 CPU-s here, once, not once per rank) and the others load its library. The compiler
    writes a temporary file that is then renamed, so no process ever loads a half-written library; the
    lock file goes once the library is in place (a process still waiting on the removed file then finds
    the library and returns; after a failed build two may compile at once, each into its own file)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.exists():
                return False
            _compile(cxx, target, isa)
            return True
        finally:
            # after the rename: whoever locks a lock file created later finds the library
            lock_path.unlink(missing_ok=True)


def _compile(cxx: str, target: Path, isa: str) -> None:
    """Compile into a temporary file next to ``target``, then rename it to ``target``."""
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        for extra in OPTIONAL_FLAGS[isa]:
            out = subprocess.run(
                [cxx, *FLAGS, *extra, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300
            )
            if out.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cxx} failed: {out.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The ``isa`` build (default: ``selected_isa()``) of the kernel library, built on first use; None (and
    ``BUILD_ERROR`` set) where it cannot be built."""
    global BUILD_SECONDS, BUILD_ERROR
    isa = isa or selected_isa()
    if isa in _libraries:
        BUILD_ERROR = _errors.get(isa)
        return _libraries[isa]
    _libraries[isa] = None
    try:
        path = library_path(isa)
        if not path.exists():
            t0 = time.perf_counter()
            if _build(path, isa):
                BUILD_SECONDS = time.perf_counter() - t0
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        BUILD_ERROR = _errors[isa] = f"{type(e).__name__}: {e}"
        return None
    ptr, i64, f64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    for name, _ in ENTRY.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr, f64, f64, f64, f64, f64, f64, i32, i32]
        fn.argtypes += [ptr] * 8 + [i64, ptr, ptr]
        fn.restype = ctypes.c_int
    lib.dflash_openmp.restype = ctypes.c_int
    lib.dflash_exp_f32.argtypes = [ptr, ptr, i64]
    lib.dflash_exp_f32.restype = None
    _libraries[isa] = lib
    return lib


def reset() -> None:
    """Forget the loaded libraries so that the next ``load()`` tries again (tests change CXX or the cache)."""
    global BUILD_SECONDS, BUILD_ERROR
    _libraries.clear()
    _errors.clear()
    BUILD_SECONDS, BUILD_ERROR = None, None


def chunk_epilogue(zs_raw, zt_raw, y, coef, g_out, t):
    """Row terms ``(lse, z_y, s_arg, t_arg, entropy, kl)`` ``[c]`` of a chunk, and G in ``g_out``, for the
    terms ``t`` (``loss.terms.LossTerms``); with ``t.pair_statistics`` also ``(overlap, renyi_half)``
    ``[c]`` (``sum_v min(p_v, q_v)`` and ``-2 log sum_v sqrt(p_v q_v)`` of the student p and teacher q at
    T = 1), and G then includes the weighted ``renyi_half`` terms' gradient, scaled by ``coef`` like the
    other terms; with ``t.top_k`` K > 0 last ``(top_ids [c, K] int64, top_logits [c, K])``: the K largest
    transformed student logits of each row, sorted descending (ties: lower id first), selected in the
    kernel's row pass.

    ``zs_raw``/``zt_raw`` ``[c, V]`` raw logits (head dtype, contiguous; ``zt_raw`` may be None, not
    with pair statistics), ``y`` ``[c]`` int64 data labels or None (teacher labels), ``coef`` ``[c]`` =
    w / sum w in the compute dtype, ``g_out`` ``[c, V]`` head dtype or None. Same math as
    ``eager.eager_chunk``; a weighted ``overlap`` term is not computed here (``t.kernel_ready``).
    """
    per_row, top_k = t.pair_statistics, t.top_k
    lib = load()
    name, compute = ENTRY[zs_raw.dtype]
    c, vocab = zs_raw.shape
    tensors = [x for x in (zs_raw, zt_raw, y, g_out) if x is not None]
    if not all(x.is_contiguous() for x in tensors) or coef.dtype != compute:
        raise ValueError("chunk_epilogue: contiguous inputs and a coef in the compute dtype are required")
    if per_row and zt_raw is None:
        raise ValueError("chunk_epilogue: the pair statistics need the teacher's logits")
    y = None if y is None else y.to(torch.int64).contiguous()
    coef = coef.contiguous()
    lse, z_y, entropy, kl, accept, renyi = (torch.empty(c, dtype=compute) for _ in range(6))
    s_arg, t_arg = torch.empty(c, dtype=torch.int64), torch.full((c,), -1, dtype=torch.int64)
    if not 0 <= top_k <= vocab:
        raise ValueError(f"chunk_epilogue: top_k must be in [0, {vocab}], got {top_k}")
    top_ids = torch.empty(c, top_k, dtype=torch.int64)
    top_logits = torch.empty(c, top_k, dtype=compute)
    top = (top_ids, top_logits) if top_k else (None, None)
    fn = getattr(lib, name)
    renyi_weight = t.gradient_weight("renyi_half")
    terms = (t.kl_weight, t.temperature, t.cap_temperature, t.logit_scale, t.softcap or 0.0, renyi_weight, int(per_row))

    def rows(r0: int, r1: int, threads: int = 1) -> int:
        def at(x, row_len):  # address of row r0 of x
            return None if x is None else x.data_ptr() + r0 * row_len * x.element_size()

        return fn(
            at(zs_raw, vocab), at(zt_raw, vocab), r1 - r0, vocab, at(y, 1), at(coef, 1), at(g_out, vocab),
            *terms, threads, at(lse, 1), at(z_y, 1), at(entropy, 1), at(kl, 1), at(s_arg, 1), at(t_arg, 1),
            at(accept, 1), at(renyi, 1), top_k, at(top[0], top_k), at(top[1], top_k),
        )  # fmt: skip

    threads = min(torch.get_num_threads(), c)
    if threads <= 1 or lib.dflash_openmp():
        codes = [rows(0, c, threads)]
    else:
        global _pool
        if _pool is None or _pool._max_workers < threads:
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dflash-loss")
        bounds = [c * i // threads for i in range(threads + 1)]
        codes = list(_pool.map(rows, bounds[:-1], bounds[1:]))
    if any(codes):
        raise ValueError(f"chunk_epilogue: the kernel refused a chunk of shape {tuple(zs_raw.shape)}")
    out = (lse, z_y, s_arg, (t_arg if zt_raw is not None else None), entropy, kl)
    out = (*out, accept, renyi) if per_row else out
    return (*out, top_ids, top_logits) if top_k else out


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's float exponential, elementwise (for its accuracy test)."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    load().dflash_exp_f32(x.data_ptr(), out.data_ptr(), x.numel())
    return out
