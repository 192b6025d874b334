"""The configuration reference, written from the schema: every setting's dotted key, type, default and
description, so the documentation cannot drift from what ``load_config`` accepts.

``markdown_reference()`` is the docs site's configuration page (``docs/hooks.py`` writes it at every
build) and what ``dflash-train config --reference`` prints. Registered variants' sections
(``drafter.<variant>``) are part of the schema by the time this runs, so they are listed too.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .schema import RunConfig


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds (``Section`` or ``Section | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def type_name(annotation: Any) -> str:
    """A reader's spelling of a field's type: ``int``, ``list[int] | null``, ``one of: a, b``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it (``null``, ``[]``, ``0.0006``); ``required`` where there is none."""
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return json.dumps(value)


def description_of(field: FieldInfo) -> str:
    """The field's description, or for a section the first paragraph of its class docstring."""
    if field.description:
        return " ".join(field.description.split())
    model = _section_of(field.annotation)
    if model is not None and model.__doc__:
        return " ".join(model.__doc__.strip().split("\n\n")[0].split())
    return ""


def settings(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """``(dotted key, field)`` of every setting under ``model``, sections before their keys, in the
    schema's order (an optional section such as ``drafter.rope_scaling`` is listed with its keys)."""
    rows = []
    for name, field in model.model_fields.items():
        rows.append((f"{prefix}{name}", field))
        section = _section_of(field.annotation)
        if section is not None:
            rows += settings(section, f"{prefix}{name}.")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_reference() -> str:
    """The reference as one Markdown page: a table per top-level section."""
    out = [
        "# Configuration reference",
        "",
        "Every setting `--config` files and `--set key=value` accept, written from the schema",
        "(`src/dflash_trainer/config/schema.py`) when the docs are built; `dflash-train config --reference`",
        "prints the same page. How a run's config is resolved: [Configuration](../configuration.md).",
        "",
    ]
    top_level = [(k, f) for k, f in settings() if "." not in k]
    plain = [(k, f) for k, f in top_level if _section_of(f.annotation) is None]
    groups = [("Run", plain)] + [
        (k, [(key, f) for key, f in settings(_section_of(field.annotation), f"{k}.")])
        for k, field in top_level
        if _section_of(field.annotation) is not None
    ]
    for title, rows in groups:
        out += [f"## {title}", ""]
        if title != "Run":
            doc = description_of(RunConfig.model_fields[title])
            out += [doc, ""] if doc else []
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, field in rows:
            is_section = _section_of(field.annotation) is not None
            kind = "section" if is_section and field.default is not None else type_name(field.annotation)
            out.append(f"| `{key}` | {_cell(kind)} | `{_cell(default_text(field))}` | {_cell(description_of(field))} |")
        out.append("")
    return "\n".join(out)
