"""MkDocs hook: the settings reference, generated from `tokenflow.config.EngineConfig` at build time.

A page holding the line `<!-- settings-table -->` gets, in its place, one table row per `EngineConfig` field
in declaration order: the name, its type with the constraints msgspec checks, its default, and the meaning
written beside the field (`_help(...)` in `tokenflow/config.py`). The struct is the one source of truth:
a new field shows up here on the next build, and `tests/test_config.py` checks that every field has a meaning.
"""

from __future__ import annotations

import html
import importlib.util
import sys
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

MARKER = "<!-- settings-table -->"


def on_config(config: Any) -> Any:
    """Let the build import `tokenflow.config` from this checkout when tokenflow is not installed: it needs only
    msgspec (in docs/requirements.txt), not torch."""
    if importlib.util.find_spec("tokenflow") is None:
        sys.path.insert(0, str(Path(config.config_file_path).resolve().parent))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, settings_table())


def settings_table() -> str:
    from tokenflow.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig, include_extras=True)
    defaults = EngineConfig()
    rows = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for field in msgspec.inspect.type_info(EngineConfig).fields:
        meaning = (field.type.extra_json_schema or {}).get("description")
        if not meaning:
            raise ValueError(f"EngineConfig.{field.name} has no description (_help(...) in tokenflow/config.py)")
        default_text = (field.type.extra or {}).get("default")
        default = (_cell(default_text) if default_text is not None
                   else _default(field.name, getattr(defaults, field.name)))
        name = f'<span id="{field.name}"></span>`{field.name}`'
        kind = html.escape(_type(hints[field.name])).replace("|", "&#124;")
        rows.append(f"| {name} | <code>{kind}</code> | {default} | {_cell(meaning)} |")
    return "\n".join(rows) + "\n"


def _type(tp: Any) -> str:
    """`Annotated[int, Meta(gt=0)] | None` -> "int > 0 | None"; Literal values quoted; containers generic."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        inner, *metas = typing.get_args(tp)
        bounds = [f"{op} {getattr(meta, attr)}" for meta in metas if isinstance(meta, msgspec.Meta)
                  for attr, op in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
                  if getattr(meta, attr) is not None]
        return " ".join([_type(inner), ", ".join(bounds)]) if bounds else _type(inner)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(arg) for arg in typing.get_args(tp))
    if origin is typing.Literal:
        return " | ".join(f'"{value}"' if isinstance(value, str) else repr(value) for value in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(arg) for arg in typing.get_args(tp))}]"
    if tp is type(None):
        return "None"
    if tp is typing.Any:
        return "Any"
    return tp.__name__


def _default(name: str, value: Any) -> str:
    text = f'"{value}"' if isinstance(value, str) else repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and name.endswith("_bytes"):
        for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
            if value >= size and value % size == 0:
                return f"`{text}` ({value // size} {unit})"
    return f"`{text}`"


def _cell(text: str) -> str:
    """Markdown kept (the backticks), but nothing that would end the table cell or the row."""
    return text.replace("|", "\\|").replace("\n", " ")
