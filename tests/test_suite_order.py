"""The suite's own scheduling (tests/conftest.py): every file ``LONGEST_FILES`` ranks is a test file here,
once, so that a renamed file does not silently fall back to the alphabetical tail of the work queue."""

from pathlib import Path

from conftest import LONGEST_FILES


def test_longest_files_name_each_test_file_once():
    here = {p.name for p in Path(__file__).parent.glob("test_*.py")}
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES)
    assert set(LONGEST_FILES) <= here, set(LONGEST_FILES) - here
