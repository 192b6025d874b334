import os

# No network at run time: every model and tokenizer in the tests comes from a local folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Under pytest-xdist (``make test`` runs test files in parallel) each worker gets its share of the
# cores for torch's OpenMP pool, and so do the processes it starts: two workers each spinning up a
# pool of every core would oversubscribe the machine. Set before any test module imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
    # A test that asks for more threads than its share (the thread-independence and two-thread
    # bit-identity checks) shares the cores with the other workers: OpenMP's default active wait spins
    # its idle threads through every slice they get (test_hardening_surfaces' two-thread DFlash2 runs:
    # 32 CPU-s against 18 passive, measured with both cores busy); a passive wait sleeps instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # vLLM's CPU build binds one OpenMP thread to every core of the NUMA node ("auto") whatever
    # OMP_NUM_THREADS says; unbound, it keeps to the worker's share (the parity fixture's six engines:
    # 56 s of CPU on one thread instead of 72 s on two, measured on 2 cores, idle)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# What importing torch, transformers, the package and the test files makes lives as long as the process:
# frozen after each full collection of the start (dflash_trainer.cli.freeze_startup_heap, torch-free to
# import), until the test files are collected (``pytest_collection_finish``; the xdist controller, which
# collects none, at ``pytest_configure``): a collection ran 7.0 CPU-s, 4.4 frozen so, and each xdist worker
# collects every file. Before torch is imported below.
from dflash_trainer.cli import freeze_startup_heap  # noqa: E402

_stop_freezing = freeze_startup_heap(None)

# The Triton loss kernel is tested on the CPU under Triton's interpreter (tests/test_loss_triton.py). Triton
# reads TRITON_INTERPRET when it is first imported, and several torch and transformers modules import it
# (a test file collected before test_loss_triton.py, or run before it in the same xdist worker, left
# the kernel's helpers compiled for a GPU: "Cannot call @triton.jit'd outside of the scope of a kernel").
import torch  # noqa: E402  (after OMP_NUM_THREADS; importing torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The planner's calibration tool lives in benchmarks/ (it is not part of the installed package).
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# Prepared data (data/prepare.py) is cached per test session, never in the home folder; subprocesses
# (CLI runs, torchrun ranks, xdist workers) inherit the variable, so they share the session's cache,
# which the process that made it removes when it exits (under xdist: the controller, which exits last).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "DFLASH_DATA_CACHE" not in os.environ:
    os.environ["DFLASH_DATA_CACHE"] = tempfile.mkdtemp(prefix="dflash-test-data-cache-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_DATA_CACHE"], ignore_errors=True)

# Drafters trained for the tests (tests/trained.py) are built once per test session, the same way: a
# folder that this session's processes share and its first process removes, never one that outlives
# the session (a drafter trained by older code must not be reused).
if "DFLASH_TEST_TRAINED_CACHE" not in os.environ:
    os.environ["DFLASH_TEST_TRAINED_CACHE"] = tempfile.mkdtemp(prefix="dflash-test-trained-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_TEST_TRAINED_CACHE"], ignore_errors=True)


# The loss's native CPU kernel is built twice (loss/native.py): for this CPU (-march=native) and for the
# architecture's baseline instruction set, so that a machine without AVX-512 (or AVX2) is exercised on
# every machine. A test or a parameter marked ``native_isa("baseline")`` runs with the baseline build
# (``NATIVE_BUILDS`` in tests/kernel_builds.py marks them); where the compiler cannot build it, the test
# is skipped and says why.
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _native_kernel_build(request, monkeypatch):
    marker = request.node.get_closest_marker("native_isa")
    if marker is None:
        return
    from dflash_trainer.loss import native

    isa = marker.args[0]
    if native.load(isa) is None:
        pytest.skip(f"the native kernel's {isa} build could not be built here: {native.BUILD_ERROR}")
    monkeypatch.setenv(native.ISA_ENV, isa)  # undone by monkeypatch after the test


# Longest files first. ``--dist loadfile`` hands each worker whole files in the order of the work queue as
# it frees up, so a long file handed out late (test_speculative.py, test_vllm_serving.py) ran while the
# other workers had nothing left: the longest-first order keeps every worker busy to the end. pytest-xdist
# (3.8 here) sorts the files by their number of tests unless told not to (``--no-loadscope-reorder``,
# which ``pytest_configure`` below sets for every run), and this order was lost (measured 2026-12-07:
# test_dspark_sampling.py, 3 tests and 116 s, was handed out among the last). The order changes only when
# a file runs, never what it checks. Ranked by the wall seconds a file's tests took in the suite, the mean
# of two warm runs (tests/cpu_report.py, 2 cores, 3 workers, 2026-12-07), every file of 15 s or more: a file
# left out runs after these in alphabetical order, so a 33 s file left out (test_trackers.py) ran last,
# one core idle for about 30 s.
LONGEST_FILES = (
    "test_speculative.py",  # 215 s
    "test_vllm_serving.py",  # 187 s
    "test_eval.py",  # 141 s
    "test_distributed.py",  # 118 s
    "test_dflash2_trained.py",  # 109 s
    "test_loss_triton.py",  # 106 s
    "test_dspark_sampling.py",  # 103 s
    "test_generate_vllm.py",  # 84 s
    "test_vllm_capture.py",  # 72 s
    "test_train.py",  # 65 s
    "test_hardening_surfaces.py",  # 64 s
    "test_foreign_drafters.py",  # 56 s
    "test_dspark.py",  # 51 s
    "test_offline.py",  # 50 s
    "test_families.py",  # 44 s
    "test_warm_start.py",  # 39 s
    "test_loss.py",  # 37 s
    "test_gpu_check.py",  # 37 s
    "test_trackers.py",  # 36 s
    "test_feature_window.py",  # 34 s
    "test_demo.py",  # 30 s
    "test_export.py",  # 27 s
    "test_on_policy.py",  # 26 s
    "test_dflash2_export.py",  # 26 s
    "test_prepared_data.py",  # 18 s
    "test_generate.py",  # 18 s
    "test_planner.py",  # 17 s
    "test_hardening_run.py",  # 16 s
)


# DFLASH_TEST_CPU_REPORT=FILE: each test's CPU seconds, its own and its subprocesses' (tests/cpu_report.py);
# ``make test`` sets it and prints the files and tests that cost most.
from cpu_report import (  # noqa: E402, F401
    pytest_runtest_protocol,
    pytest_sessionstart,
    pytest_terminal_summary,
)


def pytest_collection_finish(session):
    _stop_freezing()  # what the tests make is collected as Python collects it


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        _stop_freezing()  # the xdist controller: it collects no test file
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's; see LONGEST_FILES
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
