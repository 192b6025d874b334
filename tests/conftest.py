import os

# No network at run time: every model and tokenizer in the tests comes from a local folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The planner's calibration tool lives in benchmarks/ (it is not part of the installed package).
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# Prepared data (data/prepare.py) is cached per test session, never in the home folder; subprocesses
# (CLI runs, torchrun ranks) inherit the variable, so they share the session's cache.
import tempfile  # noqa: E402

os.environ.setdefault("DFLASH_DATA_CACHE", tempfile.mkdtemp(prefix="dflash-test-data-cache-"))
