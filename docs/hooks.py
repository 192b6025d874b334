"""MkDocs hooks (``mkdocs.yml``: ``hooks``): pages made at build time from their one source.

- ``reference/configuration.md``: every setting, from the schema (``dflash_trainer.config.reference``),
  so the reference cannot drift from what ``load_config`` accepts;
- ``benchmarks/results/*``: the committed benchmark reports (Markdown, JSON, plots) as they are in the
  repository, so ``benchmarks.md`` links to the dated figures instead of copying them.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    import dflash_trainer  # noqa: F401  (registers the built-in variants: their sections are listed)
    from dflash_trainer.config.reference import markdown_reference

    files.append(File.generated(config, "reference/configuration.md", content=markdown_reference()))
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        if path.suffix in (".md", ".png", ".json"):
            files.append(File.generated(config, f"benchmarks/results/{path.name}", abs_src_path=str(path)))
    return files
