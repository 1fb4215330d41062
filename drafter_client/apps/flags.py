"""The command line's flags, generated from the settings' fields (drafter_client/settings.py).

A field ``max_new_tokens`` is the flag ``--max-new-tokens``, its default the field's, its help
the field's description; a bool is ``--name`` / ``--no-name``, a ``Literal`` a choice, a tuple
a comma-separated list. ``cli()`` in the field's ``json_schema_extra`` spells the exceptions (a
flag of another name, a short alias, a variable the default comes from, no flag). The values
go back through the settings' own constructors, so pydantic checks them once, however they
arrive: :func:`built` turns its first error into one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any, TypeVar

from pydantic import ValidationError

T = TypeVar("T")


def _fields(cls: type) -> dict[str, Any]:
    return cls.__pydantic_fields__  # type: ignore[attr-defined,no-any-return]


def _spelling(info: Any) -> dict[str, Any]:
    return dict(info.json_schema_extra or {})


def flag_of(cls: type, name: str) -> str:
    """The flag that sets field ``name`` of ``cls`` (empty: none)."""
    return str(_spelling(_fields(cls)[name]).get("flag", "--" + name.replace("_", "-")))


def listed(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated flag's entries."""
    if isinstance(value, tuple):
        return value
    return tuple(entry.strip() for entry in value.split(",") if entry.strip())


def _scalar(annotation: Any) -> Any:
    """The scalar type of ``annotation`` (``X | None``: X)."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return args[0] if union and len(args) == 1 else annotation


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, only: tuple[str, ...] = (),
              default: Any = None) -> None:
    """One flag for each field of ``cls`` (``only``: these), defaulting to ``default``'s
    values (the class's defaults when None)."""
    defaults = default if default is not None else cls()
    for name, info in _fields(cls).items():
        if only and name not in only:
            continue
        spelling = _spelling(info)
        flag = spelling.get("flag", "--" + name.replace("_", "-"))
        annotation = _scalar(info.annotation)
        if not flag or annotation not in (int, float, str, bool) and \
                typing.get_origin(annotation) not in (typing.Literal, tuple):
            continue  # no flag, or a nested settings object (added by its own class)
        names = [spelling["short"], flag] if "short" in spelling else [flag]
        value = getattr(defaults, name)
        kwargs: dict[str, Any] = {"dest": name, "help": info.description}
        if "metavar" in spelling:
            kwargs["metavar"] = spelling["metavar"]
        if "env" in spelling:
            value = os.environ.get(spelling["env"], ",".join(value))
            kwargs["help"] += f" (default: ${spelling['env']})"
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal:
            kwargs["choices"] = typing.get_args(annotation)
        elif typing.get_origin(annotation) is tuple:
            kwargs["type"] = str
            value = ",".join(value) if isinstance(value, tuple) else value
        else:
            kwargs["type"] = annotation
        parser.add_argument(*names, default=value, **kwargs)


def built(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """``cls`` from the flags of its fields that ``args`` holds, and ``values``. ValueError, one
    line naming the flag, for a value its field refuses."""
    given = {name: listed(getattr(args, name)) if typing.get_origin(_scalar(info.annotation))
             is tuple else getattr(args, name)
             for name, info in _fields(cls).items()
             if name in args and name not in values and flag_of(cls, name)}
    try:
        return cls(**given, **values)
    except ValidationError as exc:
        raise ValueError(flag_problem(cls, exc)) from None


def flag_problem(cls: type, exc: ValidationError) -> str:
    """The first error of ``cls`` built from flags, as one line naming the flag."""
    err = exc.errors()[0]
    message = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return message
    name = str(err["loc"][0])
    value = err.get("input")
    shown = ",".join(value) if isinstance(value, tuple) else value
    said = "" if "got " in message else f" (got {shown!r})"
    return f"{flag_of(cls, name) or name}: {message}{said}"


def settings_rows(defaults: Any, only: tuple[str, ...] = ()) -> list[str]:
    """Markdown table rows, one per flag of the settings object ``defaults`` (``only``: these
    fields), with its values as the defaults."""
    lines = []
    for name, info in _fields(type(defaults)).items():
        if only and name not in only:
            continue
        spelling = _spelling(info)
        flag = spelling.get("flag", "--" + name.replace("_", "-"))
        if not flag or not info.description:
            continue
        if _scalar(info.annotation) is bool:
            flag = f"`{flag}` / `--no-{flag[2:]}`"
        else:
            flag = (f"`{spelling['short']}`, " if "short" in spelling else "") + f"`{flag}`"
        value = getattr(defaults, name)
        value = ",".join(value) if isinstance(value, tuple) else value
        shown = "empty" if value in ("", None) else f"`{value}`"
        if "env" in spelling:
            shown += f" (`${spelling['env']}`)"
        lines.append(f"| {flag} | {shown} | {info.description} |")
    return lines


if __name__ == "__main__":
    from drafter_client.apps.cli import configuration_tables

    print(configuration_tables())
