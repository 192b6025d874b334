"""Resolve a run's configuration: schema defaults < YAML sources (in order) < ``--set`` overrides.

A YAML source is a file path or the name of a built-in preset (``config/presets/*.yaml``). Every problem
is a ``ConfigError`` whose message is one line naming the file, key or value at fault, so the CLI
can print it without a traceback.
"""

from __future__ import annotations

import difflib
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import UserError
from ..io import atomic_write_text
from .schema import RunConfig


class ConfigError(UserError, ValueError):
    """A configuration problem, explained in one line."""


def preset_names() -> list[str]:
    folder = resources.files("dflash_trainer.config") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def preset_description(name: str) -> str:
    """The first comment line of a built-in preset."""
    text = (resources.files("dflash_trainer.config") / "presets" / f"{name}.yaml").read_text(encoding="utf-8")
    return next((line[1:].strip() for line in text.splitlines() if line.startswith("#")), "")


MAX_EXPANDED_NODES = 10_000  # a config expands to a few hundred values; an 800-byte alias bomb to 10^9


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that bounds what aliases expand to and refuses duplicate keys.

    Aliases: anchors, aliases and merge keys (``defaults: &d {...}``, ``<<: *d``) are ordinary YAML,
    but 800 bytes of nested aliases expand to billions of values (a "billion laughs" file), which
    whatever walks the result (validation, ``run.yaml``) would expand. So each document's expansion is
    counted on the composed node graph (shared nodes counted once per use, in time linear in the
    graph) and refused past ``MAX_EXPANDED_NODES``; a recursive alias is refused too. Duplicate keys:
    the schema promises that no setting is silently ignored, and with duplicates the YAML spec leaves
    which one wins undefined."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *d": keys written beside a merge override the merged ones, as YAML says
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, sizes: dict, open_nodes: set) -> int:
    """Values ``node`` expands to with every alias replaced by its anchor's node; ``ComposerError`` at
    the node that crosses ``MAX_EXPANDED_NODES`` or refers to itself."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise yaml.composer.ComposerError(None, None, "a recursive YAML alias (it contains itself)", node.start_mark)
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
    open_nodes.discard(key)
    if size > MAX_EXPANDED_NODES:
        raise yaml.composer.ComposerError(
            None, None, f"YAML aliases expand to more than {MAX_EXPANDED_NODES:,} values here", node.start_mark
        )
    sizes[key] = size
    return size


def strict_yaml_load(text: str):
    """``yaml.safe_load`` with bounded alias expansion and without duplicate keys (see ``_StrictLoader``)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def _read_yaml(text: str, label: str) -> dict[str, Any]:
    try:
        data = strict_yaml_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"cannot parse {label}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label} must contain a mapping of settings, not a {type(data).__name__}")
    return data


def read_source(source: str) -> tuple[dict[str, Any], str]:
    """``(settings, label)`` of a YAML file path or a built-in preset name."""
    path = Path(source)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {source}: {exc}") from None
        return _read_yaml(text, str(path)), str(path)
    if source in preset_names():
        text = (resources.files("dflash_trainer.config") / "presets" / f"{source}.yaml").read_text(encoding="utf-8")
        return _read_yaml(text, f"preset {source}"), f"preset {source}"
    if path.exists():
        raise ConfigError(f"config path {source} is not a file")
    raise ConfigError(f"config file not found: {source} (built-in presets: {', '.join(preset_names())})")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"train.lr=3e-4"`` -> ``(["train", "lr"], 3e-4)``; the value is read as YAML (so lists,
    numbers, booleans and ``null`` work) and falls back to the raw string."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} has no '=': write --set KEY=VALUE, e.g. --set train.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key part: write --set section.field=VALUE")
    try:
        value = strict_yaml_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    return parts, value


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``update`` wins, sections merge key by key."""
    merged = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _model_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema section class at a dotted location, or None if the location is not a section."""
    model: type[BaseModel] = RunConfig
    for part in path:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def valid_keys() -> list[str]:
    """Every dotted setting name, e.g. ``train.lr``."""
    keys = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
            else:
                keys.append(f"{prefix}{name}")

    walk(RunConfig, "")
    return keys


def _describe(err: dict[str, Any], origins: dict[str, str]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    dotted = ".".join(loc)
    origin = next((origins[k] for k in (dotted, *_parents(dotted)) if k in origins), None)
    if origin is None:  # an unknown section: name the source of any key under it
        origin = next((v for k, v in origins.items() if k.startswith(dotted + ".")), None)
    where = f" (from {origin})" if origin else ""
    if err["type"] == "extra_forbidden":
        section = _model_at(loc[:-1])
        candidates = list(section.model_fields) if section else []
        prefix = ".".join(loc[:-1]) + "." if len(loc) > 1 else ""
        close = difflib.get_close_matches(loc[-1], candidates, n=1, cutoff=0.5)
        if not close:  # maybe the right name in the wrong section, e.g. "lr" at top level
            same_name = [k for k in valid_keys() if k.rsplit(".", 1)[-1] == loc[-1]]
            close_full = same_name or difflib.get_close_matches(dotted, valid_keys(), n=1, cutoff=0.6)
            hint = f"; did you mean '{close_full[0]}'?" if close_full else f"; valid keys here: {', '.join(candidates)}"
        else:
            hint = f"; did you mean '{prefix}{close[0]}'?"
        return f"unknown config key '{dotted}'{where}{hint}"
    msg = err["msg"]
    if err["type"] in ("value_error", "assertion_error"):
        msg = msg.removeprefix("Value error, ")
        # A section's own check names the settings it is about: credit the source of the first one named
        # (the --set that made it), not the preset that holds the section.
        named = [k for k in origins if k.startswith(dotted + ".") and re.search(rf"\b{re.escape(k)}\b", msg)]
        if named:
            where = f" (from {origins[min(named, key=msg.index)]})"
        return f"invalid config{' in section ' + dotted if dotted else ''}{where}: {msg}"
    return f"invalid value for '{dotted}'{where}: {msg}, got {err['input']!r}"


def _parents(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def load_config(sources: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Resolve defaults < each source in order < each override in order into a ``RunConfig``."""
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for source in sources:
        data, label = read_source(source)
        merged = _merge(merged, data)
        origins.update({k: label for k in _flatten(data)})
    for item in overrides:
        parts, value = parse_override(item)
        node = merged
        for i, part in enumerate(parts[:-1]):
            prefix = tuple(parts[: i + 1])
            parent = _model_at(prefix[:-1])
            child = node.setdefault(part, {})
            if not isinstance(child, dict) or (parent and part in parent.model_fields and _model_at(prefix) is None):
                raise ConfigError(f"cannot set '{'.'.join(parts)}': '{'.'.join(prefix)}' is a value, not a section")
            node = child
        node[parts[-1]] = value
        origins[".".join(parts)] = f"--set {item}"
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as exc:
        errors = exc.errors()
        first = _describe(errors[0], origins)
        more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
        raise ConfigError(first + more) from None


def dump_config(config: RunConfig) -> str:
    """YAML of the fully resolved config; ``load_config([that file])`` gives the same config back."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def write_resolved_config(config: RunConfig, out_dir: Path) -> Path:
    """Write ``run.yaml`` into ``out_dir`` (created) atomically and return its path. An ``out_dir`` that
    cannot be a folder (a file, a file above it, read-only, a full disk) is a ``UserError``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output_dir {out_dir} is a file, not a folder; choose another output_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(out_dir / "run.yaml", dump_config(config))
    except OSError as exc:
        raise UserError(f"cannot write to output_dir {out_dir}: {exc.strerror or exc}") from None
