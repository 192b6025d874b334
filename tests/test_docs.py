"""The documentation: the docs site builds strictly (a broken link, a page missing from the nav, a bad
anchor fail), the README stays a short front page whose links resolve, and the configuration reference
lists every setting the schema accepts, each with a description."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import in_process

import dflash_trainer  # noqa: F401  (registers the built-in variants)
from dflash_trainer.config import valid_keys
from dflash_trainer.config.reference import description_of, markdown_reference, settings

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
MKDOCS_ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        print("SKIP: mkdocs is not installed here (pip install -e '.[docs]', or make test)")
        pytest.skip("mkdocs is not installed (the test and docs extras install it)")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=MKDOCS_ENV)


def test_docs_site_builds_strictly_and_a_broken_link_fails_it(tmp_path):
    built = mkdocs_build(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    reference = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "train.lr" in reference and "drafter.dspark.markov_rank" in reference  # written by docs/hooks.py
    assert (tmp_path / "site" / "benchmarks" / "results" / "loss" / "index.html").is_file()

    # the control: the same tree with one broken link does not build
    copy = tmp_path / "copy"
    for name in ("mkdocs.yml", "docs", "benchmarks/results"):
        dest = copy / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, dest)
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    broken = mkdocs_build(copy, tmp_path / "broken-site")
    assert broken.returncode != 0
    assert "no-such-page.md" in broken.stdout + broken.stderr


def test_readme_is_a_short_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    # it opens with the two commands that work on a fresh machine
    assert lines[3].startswith("make demo ") and lines[4].startswith("make test "), lines[:6]
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(local) > 20  # the front page points into the docs
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_every_docs_page_is_in_the_nav():
    """mkdocs only warns about a page left out of the nav (strict makes it an error): checked here by
    name too, so the list in mkdocs.yml and the folder cannot part."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert pages and not [page for page in pages if f": {page}" not in nav]


def test_the_reference_lists_every_setting_with_a_description():
    reference = markdown_reference()
    keys = valid_keys()
    assert len(keys) > 80
    assert not [key for key in keys if f"| `{key}` |" not in reference]
    assert not [key for key, field in settings() if not description_of(field)]
    # the optional section's keys are listed although valid_keys stops at the section
    assert "| `drafter.rope_scaling.factor` |" in reference


def test_config_reference_command_prints_the_reference():
    result = in_process("config", "--reference")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == markdown_reference().strip()
