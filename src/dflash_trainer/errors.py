"""The one exception type the command line reports as a single line instead of a traceback, and the
one way a file this project reads (a manifest, a foreign config) is checked against its schema."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class UserError(Exception):
    """A problem with the user's input (config, paths, data), explained in one line."""


class JsonRecord(BaseModel):
    """The base of the typed schemas ``check_schema`` reads files with: JSON's own types (strict: "3" is
    not an int), extra keys kept (fields a newer writer added)."""

    model_config = ConfigDict(strict=True, extra="allow")


def check_schema(schema, value, where: str, fix: str, error: type[UserError] = UserError):
    """``schema.model_validate(value)`` (a pydantic model), or ``error``: one line naming ``where``, the
    first bad field, what it should be, and ``fix``. Every manifest and foreign config goes through
    here, so a field of the wrong type or a missing one is never a ``KeyError`` deep in the code."""
    from pydantic import ValidationError

    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        got = "" if first["type"] == "missing" else f" (got {first.get('input')!r:.60})"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise error(f"{where}: field {field}: {first['msg']}{got}{more}; {fix}") from None
